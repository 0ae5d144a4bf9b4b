"""What a worker's collate and pack of one batch cost with the arena written by streaming stores
(``MTC_PACK_NT=1``, the default) and by ``memcpy`` (``MTC_PACK_NT=0``), alternated in one process.

    python3 tools/diagnostics/pack_stores.py [--rounds 12] [--per-round 10] [--height 256 --width 448]

The batches are bench_train's ``launch4`` samples (per sample 6 camera images, made anew per index
as that configuration's workers make them, and 33 small meta-data tensors; batch 8: 16.6 MB at
256x448) through ``PackedCollate(collate_samples)``, called in this process as a DataLoader worker
calls it: ``default_collate`` stacks the images into warm scratch memory, then the pack writes the
batch into the arena. Each batch's region is freed at once. Per round, each setting packs
``--per-round`` batches (the order alternating between rounds); the milliseconds per batch are
printed as the median, minimum and maximum over rounds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench"))

import mtc_loader  # noqa: E402
from bench_train import CameraSamples, collate_samples  # noqa: E402
from workloads import count_tensors  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--per-round", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--height", type=int, default=256)
    p.add_argument("--width", type=int, default=448)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.per_round < 1:
        p.error("--rounds and --per-round must be at least 1")
    ds = CameraSamples(4 * args.batch_size, 4 * args.batch_size, args.height, args.width, fresh=True)
    samples = [ds[i] for i in range(args.batch_size)]
    _, batch_bytes = count_tensors(collate_samples(samples))
    pc = mtc_loader.PackedCollate(collate_samples, arena_bytes=4 * batch_bytes + (16 << 20))
    for _ in range(8):  # warm: every part of the arena mapped (regions cycle through it), scratch made
        del_me = pc(samples)
        del del_me
    before = os.environ.get("MTC_PACK_NT")
    ms: dict[str, list[float]] = {"1": [], "0": []}
    nbytes = 0
    try:
        for r in range(args.rounds):
            for nt in ("1", "0") if r % 2 == 0 else ("0", "1"):
                os.environ["MTC_PACK_NT"] = nt  # read at every pack
                t0 = time.perf_counter()
                for _ in range(args.per_round):
                    pb = pc(samples)
                    nbytes = pb.nbytes
                    del pb  # an unconsumed batch frees its region
                ms[nt].append((time.perf_counter() - t0) * 1e3 / args.per_round)
    finally:
        if before is None:
            os.environ.pop("MTC_PACK_NT", None)
        else:
            os.environ["MTC_PACK_NT"] = before
    print(f"collate + pack of one batch ({nbytes / 1e6:.1f} MB, {args.rounds} rounds x {args.per_round} batches), "
          f"ms per batch:")
    for nt, label in (("1", "streaming stores (MTC_PACK_NT=1)"), ("0", "memcpy (MTC_PACK_NT=0)")):
        v = ms[nt]
        print(f"  {label:<34} median {statistics.median(v):.3f}  min {min(v):.3f}  max {max(v):.3f}")
    print(f"  ratio of medians, memcpy / streaming: {statistics.median(ms['0']) / statistics.median(ms['1']):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
