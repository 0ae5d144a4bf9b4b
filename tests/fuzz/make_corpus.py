"""Writes the seed corpus of the fuzz harnesses: tests/fuzz/corpus/<harness>/.

    python3 tests/fuzz/make_corpus.py          (needs mtc_loader built in place)

layout: real layouts, made by the engine (``_engine.pack``, as ``PackedCollate`` does in a
DataLoader worker) from batches of every dtype and of the shapes that matter (the reference
meta-data batch, 0-d, zero-size, non-contiguous, numpy), under several alignments, each behind
the harness's 5-byte prefix (mode byte 0: module.c's region rule); and a few generator inputs for
the round-trip modes (mode byte 0x80, perturbed 0xc0). plan, arena: generator bytes from a fixed seed (every byte
string is a valid input of those harnesses). Deterministic: rerunning it rewrites the same files
(and leaves the ``found-*`` inputs of longer fuzzing runs alone: see README.md).
"""
from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import numpy as np
import torch

import mtc_loader
from mtc_loader import _engine

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus"

sys.path.insert(0, str(HERE.parent))  # the test suite's builders: one definition of the sample
from conftest import random_tensor, seed_sample  # noqa: E402


def batches():
    """(name, batch, alignment) of the layout seeds."""
    rng = random.Random(1)
    g = torch.Generator().manual_seed(1)
    dts = list(mtc_loader._setup.DTYPES)
    yield "empty", [], 16
    yield "one-tensor", [torch.arange(5)], 16
    yield "example-1-sample", [seed_sample(rng, g)], 16
    yield "example-2-samples-align4096", [seed_sample(rng, g) for _ in range(2)], 4096
    yield "every-dtype", [random_tensor(dt, (3, 2), g) for dt in dts], 16
    yield "every-dtype-align1", [random_tensor(dt, (rng.randint(0, 3),), g) for dt in dts], 1
    yield "scalars-and-zero-size", [random_tensor(dts[i % len(dts)], s, g) for i, s in
                                    enumerate([(), (), (0,), (0, 5), (2, 0, 3), (), (1,)])], 8
    yield "same-shape-uniform", [random_tensor(torch.float32, (3, 5), g) for _ in range(6)], 16
    yield "split-rows", [random_tensor(torch.int16, (rng.randint(0, 9), 3), g) for _ in range(8)], 32
    yield "non-contiguous", [random_tensor(torch.float64, (4, 6), g).t(), torch.arange(20)[::3],
                             torch.zeros(3, 1).expand(3, 4), random_tensor(torch.uint8, (5, 5), g)[1:, 2:]], 16
    yield "numpy", [np.arange(12, dtype=np.float32).reshape(3, 4), np.arange(5)[::-1].copy(),
                    np.array(True), np.zeros((0, 3), np.int8), np.arange(6, dtype=np.complex64)], 16
    yield "mixed-align2", [random_tensor(dts[rng.randrange(len(dts))], (rng.randint(0, 4), 2), g)
                           for _ in range(12)], 2


def write(harness: str, name: str, data: bytes) -> None:
    d = CORPUS / harness
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data)


def main() -> int:
    arena = mtc_loader.Arena(1 << 24)
    pid = os.getpid()
    for name, batch, align in batches():
        off, nbytes, layout, _skeleton, _atoms = _engine.pack(arena._a, batch, align, 5.0)
        arena._a.release(off, pid)
        write("layout", f"decode-{name}", bytes([0]) + bytes(4) + layout)
        if name in ("example-1-sample", "every-dtype"):
            # the same layouts under the other region rules: tight (2), small explicit (1)
            write("layout", f"decode-{name}-tight", bytes([2]) + (align - 1).to_bytes(4, "little") + layout)
            write("layout", f"decode-{name}-region", bytes([1]) + (nbytes + align).to_bytes(4, "little") + layout)
    r = random.Random(7)
    for i in range(8):
        n = r.choice([8, 32, 96, 256])
        write("layout", f"roundtrip-{i}", bytes([0x80]) + bytes(r.randrange(256) for _ in range(n)))
    for i in range(4):
        n = r.choice([32, 96, 256])
        write("layout", f"perturbed-{i}", bytes([0xc0]) + bytes(r.randrange(256) for _ in range(n)))
    for i in range(12):
        n = r.choice([4, 16, 64, 200, 600])
        write("plan", f"seed-{i}", bytes(r.randrange(256) for _ in range(n)))
    for i in range(12):
        n = r.choice([16, 64, 200, 400])
        write("arena", f"seed-{i}", bytes([i & 1]) + bytes(r.randrange(256) for _ in range(n)))
    print(f"wrote the corpus under {CORPUS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
