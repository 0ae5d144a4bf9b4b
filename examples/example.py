"""Reference example: copy a batch of multi-camera training meta-data to the GPU.

The batch is what a multi-camera 3D object detection pipeline hands the GPU every step: a list
of per-sample dicts holding many small tensors whose sizes vary from sample to sample (so they
cannot be stacked into per-batch tensors). ``mtc_loader.start_copy`` copies the whole nested
structure in the background; the caller overlaps other work and collects the result with
``handle.get()``.

Run it with::

    python3 examples/example.py

It uses ``cuda:0`` when a GPU is available: it then also times the copy against moving each
tensor with ``tensor.to(device)`` (what a training loop does without mtc_loader), in the same run,
and prints both. Without a GPU it copies to the CPU, where tensors already there are returned as
they are (by ``start_copy`` as by ``.to``), so there is no speed-up to show: it says so and only
checks the result. The exit code is 0 when every copied tensor equals its input, 1 otherwise.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Iterator

import torch

from mtc_loader import start_copy

NUM_CAMERAS = 6
NUM_CLASSES = 10
BATCH_SIZE = 16
SEED = 0


def _randint(gen: torch.Generator, low: int, high: int) -> int:
    """One integer drawn uniformly from ``[low, high]`` (both inclusive)."""
    return int(torch.randint(low, high + 1, (1,), generator=gen).item())


def create_sample_meta_data(gen: torch.Generator) -> dict[str, Any]:
    """One sample's meta-data, as a multi-camera 3D detection pipeline produces it.

    - ``"cams_gt"``: one dict per camera with the 2D ground truth of the objects visible in
      that image (their number ``N`` varies per image) and the camera's projection matrix.
    - ``"gt_data"``: the sample's 3D ground truth (its number of objects varies per sample).
    """
    cams_gt = []
    for _ in range(NUM_CAMERAS):
        n = _randint(gen, 10, 64)  # objects visible in this camera image
        cams_gt.append(
            {
                "bounding_boxes": torch.rand(n, 4, generator=gen),  # (N, 4) float32
                "class_ids": torch.randint(0, NUM_CLASSES, (n,), generator=gen),  # (N,) int64
                "active": torch.randint(0, 2, (n,), generator=gen, dtype=torch.bool),  # (N,)
                "depths": torch.rand(n, generator=gen) * 80.0,  # (N,) float32, in metres
                "proj_mat": torch.rand(3, 4, generator=gen),  # (3, 4) float32
            }
        )

    n = _randint(gen, 45, 120)  # ground-truth objects in this sample
    gt_data = {
        "bounding_boxes_3d": torch.rand(n, 7, generator=gen),  # (N, 7) float32
        "class_ids": torch.randint(0, NUM_CLASSES, (n,), generator=gen),  # (N,) int64
        "active": torch.randint(0, 2, (n,), generator=gen, dtype=torch.bool),  # (N,) bool
    }
    return {"cams_gt": cams_gt, "gt_data": gt_data}


def create_batch_meta_data(batch_size: int = BATCH_SIZE, seed: int = SEED) -> list[dict]:
    """A batch of per-sample meta-data dicts (in real training, the DataLoader's output)."""
    gen = torch.Generator().manual_seed(seed)
    return [create_sample_meta_data(gen) for _ in range(batch_size)]


def iter_tensors(data: Any, path: str = "batch") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(path, tensor)`` for every tensor in a nested list / tuple / dict structure."""
    if isinstance(data, torch.Tensor):
        yield path, data
    elif isinstance(data, dict):
        for key, value in data.items():
            yield from iter_tensors(value, f"{path}[{key!r}]")
    elif isinstance(data, (list, tuple)):
        for i, value in enumerate(data):
            yield from iter_tensors(value, f"{path}[{i}]")


def other_work(device: torch.device) -> torch.Tensor:
    """Stand-in for useful work done while the copy is in flight (e.g. a forward pass)."""
    x = torch.randn(512, 512, device=device)
    return x @ x


def tree_to(data: Any, device: torch.device) -> Any:
    """The structure with every tensor moved by its own ``tensor.to(device)``: the usual way."""
    if isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=True)
    if isinstance(data, dict):
        return {key: tree_to(value, device) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(tree_to(value, device) for value in data)
    return data


def time_against_to(batch: Any, device: torch.device, reps: int = 20) -> tuple[float, float]:
    """Median seconds, over ``reps`` warm runs each, until the batch is usable on ``device``:
    ``start_copy(batch, device).get()``, and ``.to(device)`` per tensor (each followed by a
    device synchronization, so that both include the transfers themselves)."""
    def timed(fn: Any) -> float:
        fn()  # warm: buffers, threads, the CUDA context
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    return timed(lambda: start_copy(batch, device).get()), timed(lambda: tree_to(batch, device))


def check_copy(inputs: list[dict], outputs: list[dict], device: torch.device) -> list[str]:
    """Compare every output tensor with its input; returns a description of each mismatch."""
    in_tensors = list(iter_tensors(inputs))
    out_tensors = list(iter_tensors(outputs))
    if len(in_tensors) != len(out_tensors):
        return [f"{len(out_tensors)} output tensors for {len(in_tensors)} inputs"]

    problems = []
    for (path, inp), (out_path, out) in zip(in_tensors, out_tensors):
        if out_path != path:
            problems.append(f"{path}: the output has {out_path} in its place")
        elif out.device.type != device.type or (
            device.index is not None and out.device.index != device.index
        ):
            problems.append(f"{path}: on {out.device}, expected {device}")
        elif out.dtype != inp.dtype or out.shape != inp.shape:
            problems.append(f"{path}: {out.dtype} {tuple(out.shape)}, "
                            f"expected {inp.dtype} {tuple(inp.shape)}")
        elif not torch.equal(out.cpu(), inp):
            problems.append(f"{path}: values differ from the input")
    return problems


def main() -> int:
    # ----------------------- Create the batch meta-data -----------------------

    # The per-sample tensors are not combined into per-batch tensors: the number of objects
    # varies per camera image and per sample, so stacking would need padding or index
    # bookkeeping. The batch stays a list of dicts of many small tensors.
    batch = create_batch_meta_data()
    num_tensors = sum(1 for _ in iter_tensors(batch))
    num_bytes = sum(t.nbytes for _, t in iter_tensors(batch))

    if torch.cuda.is_available():
        device = torch.device("cuda:0")
    else:
        print("No CUDA device is available: copying to 'cpu' instead. Tensors already on the CPU are "
              "returned as they are (by start_copy, as by tensor.to('cpu')), so this run only checks "
              "the result: the speed-up over tensor.to() is that of CPU -> GPU copies and needs a GPU.")
        device = torch.device("cpu")

    # ------------------------ Start the asynchronous copy ------------------------

    # start_copy() walks the nested lists / tuples / dicts and copies every tensor to `device`.
    # It returns a handle right away: small tensors are packed into pinned staging buffers and
    # sent with one transfer per buffer, all on a background thread.
    #
    # Contract: the input tensors must not be freed or modified in place until the copy has
    # completed, i.e. until handle.get() returns (or handle.ready() is True).
    t0 = time.perf_counter()
    handle = start_copy(batch, device)
    t_start = time.perf_counter() - t0

    # -------------------- Overlap with other work --------------------

    # The calling thread is free while the copy proceeds: do something that does not need
    # the copied data (computations, logging, ...).
    t1 = time.perf_counter()
    other_work(device)
    t_other = time.perf_counter() - t1

    # -------------------- Retrieve and use the results --------------------

    # get() blocks until the copies are enqueued on the current CUDA stream and returns the same
    # nested structure, with every tensor on `device`. Like tensor.to(device, non_blocking=True),
    # work queued afterwards on the same stream sees the data; code on the host that needs the
    # copy to be finished synchronizes first.
    t2 = time.perf_counter()
    gpu_batch = handle.get()
    t_get = time.perf_counter() - t2
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t_done = time.perf_counter() - t0

    # Consume the result: here, check that every tensor arrived intact.
    problems = check_copy(batch, gpu_batch, device)
    for problem in problems:
        print(f"MISMATCH {problem}")

    if device.type == "cuda":
        print(f"copied {num_tensors} tensors ({num_bytes / 1e3:.1f} KB) "
              f"in {len(batch)} samples to {device}")
    else:
        print(f"start_copy to {device}: {num_tensors} tensors ({num_bytes / 1e3:.1f} KB) in {len(batch)} "
              f"samples, returned as they are (already there: no copy)")
    print(f"  start_copy() returned after {t_start * 1e3:8.3f} ms")
    print(f"  other work (overlapped)     {t_other * 1e3:8.3f} ms")
    print(f"  get() then waited           {t_get * 1e3:8.3f} ms")
    print(f"  data usable on {str(device):<6} after {t_done * 1e3:8.3f} ms from start_copy()")
    if device.type == "cuda":
        print("  (a first call includes one-time set-up: pinned buffers, threads, CUDA context)")
    sample = gpu_batch[0]
    print(f"  sample 0: {len(sample['cams_gt'])} cameras, "
          f"{sample['gt_data']['bounding_boxes_3d'].shape[0]} GT objects, "
          f"on {sample['gt_data']['bounding_boxes_3d'].device}")
    if device.type == "cuda":
        # the point of it: the same batch, warm, against one tensor.to() per tensor
        t_mtc, t_to = time_against_to(batch, device)
        print(f"warm copies of the batch to {device}, until usable (median of 20):")
        print(f"  mtc_loader.start_copy().get()  {t_mtc * 1e3:8.3f} ms")
        print(f"  tensor.to() per tensor         {t_to * 1e3:8.3f} ms   "
              f"({t_to / t_mtc:.1f}x the time of start_copy)")
    print("OK: every tensor matches its input" if not problems
          else f"FAILED: {len(problems)} of {num_tensors} tensors differ")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
