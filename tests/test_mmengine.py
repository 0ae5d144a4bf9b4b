"""mtc_loader.mmengine: a real ``Runner.train()`` with the config switch gives the model bitwise the
data that mmengine's own pipeline (``pseudo_collate`` + ``cast_data``) gives it.

The samples hold data samples (a ``Det3DDataSample``-like subclass of ``BaseDataElement`` with a
property-backed field) whose ``InstanceData`` carries variable-length boxes (a box class that
wraps a tensor, registered here) and labels, plus metainfo with numpy arrays and a non-tensor
data field. Skipped where mmengine is not installed. The ``cuda`` variants run on the GPU
machine.
"""
from __future__ import annotations

import pickle
import re
import subprocess
import sys
import time
import warnings
from unittest import mock

import numpy as np
import pytest
import torch

with warnings.catch_warnings():  # mmengine's imports warn (torch.jit.script is deprecated)
    warnings.simplefilter("ignore")
    mmengine = pytest.importorskip("mmengine", reason="needs mmengine (the test extra installs it)")
    from mmengine.dataset import pseudo_collate
    from mmengine.model import BaseDataPreprocessor, BaseModel
    from mmengine.registry import FUNCTIONS, LOOPS, MODELS
    from mmengine.runner import Runner
    from mmengine.structures import BaseDataElement, InstanceData, PixelData

    import mtc_loader
    import mtc_loader.mmengine as mm
from conftest import assert_bitwise, requires_cuda  # noqa: E402,I100
from frameworks import SlowLoading  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda:0", marks=requires_cuda)]

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]


class LiDARBoxes:
    """mmdet3d's LiDARInstance3DBoxes in small: an (N, 7) tensor plus plain fields."""

    def __init__(self, tensor: torch.Tensor, box_dim: int = 7, with_yaw: bool = True, origin=(0.5, 0.5, 0)):
        assert isinstance(tensor, torch.Tensor) and tensor.dim() == 2 and tensor.shape[1] == box_dim
        self.tensor, self.box_dim, self.with_yaw, self.origin = tensor, box_dim, with_yaw, origin

    def __len__(self) -> int:
        return self.tensor.shape[0]

    def to(self, device, *args, **kwargs) -> "LiDARBoxes":
        return type(self)(self.tensor.to(device, *args, **kwargs), self.box_dim, self.with_yaw, self.origin)


def _boxes_flatten(b):
    return [b.tensor], (type(b), b.box_dim, b.with_yaw, b.origin)


def _boxes_unflatten(values, context):
    cls, box_dim, with_yaw, origin = context
    b = cls.__new__(cls)
    b.tensor, b.box_dim, b.with_yaw, b.origin = values[0], box_dim, with_yaw, origin
    return b


mtc_loader.register_container(LiDARBoxes, _boxes_flatten, _boxes_unflatten)


class Det3DSample(BaseDataElement):
    """mmdet3d's Det3DDataSample in small: a property stored in the private field."""

    @property
    def gt_instances_3d(self) -> InstanceData:
        return self._gt_instances_3d

    @gt_instances_3d.setter
    def gt_instances_3d(self, value: InstanceData) -> None:
        self.set_field(value, "_gt_instances_3d", dtype=InstanceData)


def make_sample(i: int) -> dict:
    g = torch.Generator().manual_seed(i)
    n = 1 + (i * 7) % 23  # variable-length boxes and labels
    gt = InstanceData(metainfo={"sample_idx": i})
    gt.bboxes_3d = LiDARBoxes(torch.rand(n, 7, generator=g))
    gt.labels_3d = torch.randint(0, 10, (n,), generator=g)
    gt.names = [f"c{j}" for j in range(n)]  # a non-tensor data field: kept as it is
    ds = Det3DSample(metainfo={"lidar2img": np.eye(4) * i, "token": f"tok{i}", "box_type_3d": LiDARBoxes})
    ds.gt_instances_3d = gt
    ds.depth = PixelData(data=torch.rand(1, 4, 6, generator=g))
    ds.eval_ann = np.arange(n)  # numpy in a data field: BaseDataElement.to keeps it
    return {"inputs": {"points": torch.rand(100 + 13 * i, 4, generator=g)}, "data_samples": ds}


class Samples(torch.utils.data.Dataset):
    metainfo = {"classes": tuple(f"c{j}" for j in range(10))}

    def __init__(self, n: int = 12) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return make_sample(i)


def snapshot(x):
    """What the model received, as plain comparable values (tensors cloned with their device)."""
    if isinstance(x, torch.Tensor):
        return ("tensor", str(x.device), x.detach().cpu().clone())
    if isinstance(x, BaseDataElement):
        d = {k: (sorted(v) if k in ("_metainfo_fields", "_data_fields") else snapshot(v))
             for k, v in vars(x).items()}
        return (type(x).__name__, sorted(d.items(), key=lambda kv: kv[0]))
    if isinstance(x, LiDARBoxes):
        return ("LiDARBoxes", snapshot(x.tensor), x.box_dim, x.with_yaw, x.origin)
    if isinstance(x, dict):
        return (type(x).__name__, [(k, snapshot(v)) for k, v in x.items()])
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, [snapshot(v) for v in x])
    if isinstance(x, np.ndarray):
        return ("ndarray", x.dtype.str, x.tolist())
    return x


def assert_same(a, b, where="batch"):
    if isinstance(a, tuple) and a and a[0] == "tensor":
        assert isinstance(b, tuple) and b[0] == "tensor", where
        assert a[1] == b[1], f"{where}: device {a[1]} != {b[1]}"
        assert_bitwise(a[2], b[2], where)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {a!r:.200} != {b!r:.200}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


SEEN: list = []


class ToyModel(BaseModel):
    def __init__(self, data_preprocessor=None) -> None:
        super().__init__(data_preprocessor=data_preprocessor)
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, inputs, data_samples=None, mode="tensor"):
        SEEN.append(snapshot({"inputs": inputs, "data_samples": data_samples}))
        loss = self.w.sum() * sum(float(p.sum()) for p in inputs["points"]) * 0
        return {"loss": loss}


def train(tmp_path, device, workers, switch, *, loop="epoch", context=None):
    """The batches the model received in one epoch (max_iters 3 for the iteration loop)."""
    SEEN.clear()
    pre = dict(type="BaseDataPreprocessor")
    # the iteration loop's prefetching runs up to prefetch_depth batches ahead: more samples than
    # max_iters needs, so that it does not restart the DataLoader at the end
    loader = dict(dataset=Samples(12 if loop == "epoch" else 24), sampler=dict(type="DefaultSampler", shuffle=False), batch_size=4,
                  num_workers=workers, persistent_workers=False)
    if context is not None:
        loader["multiprocessing_context"] = context
    if loop == "epoch":
        train_cfg = dict(by_epoch=True, max_epochs=1)
    else:
        train_cfg = dict(type="IterBasedTrainLoop", max_iters=3)
    if switch:
        loader["collate_fn"] = dict(type="mtc_packed_collate")
        pre = dict(type="MTCDataPreprocessor", preprocessor=pre, arena_bytes=64 << 20)
        train_cfg = dict(train_cfg, type="MTCEpochBasedTrainLoop" if loop == "epoch" else "MTCIterBasedTrainLoop")
        train_cfg.pop("by_epoch", None)
    # the Runner puts the model on mmengine.device.get_device() (CUDA wherever there is one): here
    # on the device under test
    with mock.patch("mmengine.runner.runner.get_device", return_value=device):
        return _train(tmp_path, switch, pre, loader, train_cfg)


def _train(tmp_path, switch, pre, loader, train_cfg):
    runner = Runner(
        model=ToyModel(data_preprocessor=pre), work_dir=str(tmp_path / ("on" if switch else "off")),
        train_dataloader=loader, train_cfg=train_cfg, optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.01)),
        default_hooks=dict(checkpoint=None, logger=None), log_level="ERROR",
        env_cfg=dict(cudnn_benchmark=False, dist_cfg=dict(backend="gloo")),
        default_scope=None, cfg=dict(),
    )
    runner.train()
    return list(SEEN)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("workers", [0, 2])
def test_runner_train_gets_the_same_data(tmp_path, device, workers):
    ref = train(tmp_path, device, workers, switch=False)
    before = mm.packed_collate.arena
    allocs = before.stats()["allocs"] if before is not None else 0
    with mock.patch.object(BaseDataPreprocessor, "cast_data", autospec=True,
                           side_effect=BaseDataPreprocessor.cast_data) as cast:
        got = train(tmp_path, device, workers, switch=True)
    assert cast.call_count == 0  # prefetched on the device: no per-tensor .to() on the training thread
    assert len(ref) == len(got) == 3
    after = mm.packed_collate.arena  # a new one where an earlier test left a smaller arena
    assert after.stats()["allocs"] == (allocs if after is before else 0) + 3  # every batch was packed
    assert_same(got, ref)
    tags = set()
    devices = set()
    _walk(got, tags, devices)
    assert devices == {str(torch.device(device))}
    assert {"Det3DSample", "InstanceData", "PixelData", "LiDARBoxes"} <= tags


def _walk(snap, tags, devices):
    if isinstance(snap, tuple) and snap and snap[0] == "tensor":
        devices.add(snap[1])
        return
    if isinstance(snap, (tuple, list)):
        if snap and isinstance(snap[0], str):
            tags.add(snap[0])
        for x in snap:
            _walk(x, tags, devices)


@pytest.mark.parametrize("device", DEVICES)
def test_iteration_loop_and_spawn_workers(tmp_path, device):
    ref = train(tmp_path, device, 2, switch=False, loop="iter", context="spawn")
    got = train(tmp_path, device, 2, switch=True, loop="iter", context="spawn")
    assert len(ref) == len(got) == 3
    assert_same(got, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_preprocessor_unpacks_a_packed_batch_with_the_inner_pipeline(device):
    batch = [make_sample(i) for i in range(5)]
    pre = mm.MTCDataPreprocessor(dict(type="BaseDataPreprocessor")).to(device)
    assert pre.device == pre.preprocessor.device == torch.device(device)
    ref = BaseDataPreprocessor().to(device)(pseudo_collate(batch))
    packed = FUNCTIONS.get("mtc_packed_collate")(batch)
    assert isinstance(packed, mtc_loader.PackedBatch)
    out = pre(packed)
    assert_same(snapshot(out), snapshot(ref))
    # not packed: the wrapped preprocessor's own cast_data
    assert_same(snapshot(pre(pseudo_collate(batch))), snapshot(ref))


@MODELS.register_module(force=True)
class PeekingPreprocessor(BaseDataPreprocessor):
    """Reads the batch before its cast_data (as Det3DDataPreprocessor does), then transforms."""

    def forward(self, data, training=False):
        n = len(data["inputs"]["points"])
        data = self.cast_data(data)
        return {"inputs": {"points": [p * 2 for p in data["inputs"]["points"]], "n": n},
                "data_samples": data["data_samples"]}


@pytest.mark.parametrize("device", DEVICES)
def test_wrapped_preprocessor_runs_on_the_unpacked_batch_with_cast_data_a_no_op(device):
    batch = [make_sample(i) for i in range(3)]
    ref = PeekingPreprocessor().to(device)(pseudo_collate(batch))
    pre = mm.MTCDataPreprocessor(dict(type="PeekingPreprocessor")).to(device)
    with mock.patch.object(BaseDataPreprocessor, "cast_data", autospec=True,
                           side_effect=BaseDataPreprocessor.cast_data) as cast:
        out = pre(mm.packed_collate(batch), True)
        assert cast.call_count == 0  # the batch was on the device: nothing moved twice
        plain = pre(pseudo_collate(batch), True)
        assert cast.call_count > 0  # a batch that is not packed: the wrapped cast_data as usual
    assert_same(snapshot(out), snapshot(ref))
    assert_same(snapshot(plain), snapshot(ref))


def test_a_prefetched_batch_is_freed_where_the_loop_drops_it():
    # the mark that tells the preprocessor "on the device already" lets go of the batch once its
    # forward has it: the loop's own `del` frees the batch, not the next hand-out
    import gc
    import weakref
    batches = [[make_sample(i) for i in range(k, k + 2)] for k in range(0, 6, 2)]
    pre = mm.MTCDataPreprocessor(dict(type="BaseDataPreprocessor"))
    it = mm._loops._Prefetching([mm.packed_collate(b) for b in batches], torch.device("cpu"), 2)
    gc.disable()  # only reference counts free the batch here
    try:
        for _ in batches:  # (a for over enumerate() would keep its last item until the next)
            data = next(it)
            out = pre(data, True)
            assert mm._preprocessor._MOVED.batch is None
            leaf = weakref.ref(out["data_samples"][0].gt_instances_3d.labels_3d)
            del data, out
            assert leaf() is None, "the batch outlived the loop's del"
        with pytest.raises(StopIteration):
            next(it)
    finally:
        gc.enable()
        it.close()
    # a batch handed out and never given to forward is released by the next hand-out
    it = mm._loops._Prefetching([mm.packed_collate(b) for b in batches], torch.device("cpu"), 2)
    try:
        first = next(it)
        assert mm._preprocessor._MOVED.batch is first
        next(it)
        assert mm._preprocessor._MOVED.batch is not first
    finally:
        it.close()


class WithExtras(InstanceData):
    """A user subclass with extra fields of every kind."""


def test_subclass_with_extra_fields_round_trips():
    e = WithExtras(metainfo={"scale": np.array([1.5, 2.0]), "flip": True})
    e.boxes = torch.rand(3, 4)
    e.scores = torch.rand(3)
    e.tags = ["a", "b", "c"]
    e.mask = np.ones((3, 2), bool)
    e.nested = [torch.ones(1), torch.zeros(1), torch.ones(1)]  # a list: kept as it is (not moved by .to)
    e.sub = InstanceData(x=torch.arange(3))
    packed = mm.packed_collate([{"e": e}])
    out = packed.unpack("cpu")["e"][0]
    ref = pseudo_collate([{"e": e}])["e"][0].to("cpu")
    assert type(out) is WithExtras
    assert_same(snapshot(out), snapshot(ref))
    assert sorted(out.metainfo_keys()) == sorted(ref.metainfo_keys()) == ["flip", "scale"] and out.flip is True
    assert len(out) == 3 and isinstance(out[0:2], WithExtras)  # still a working InstanceData
    out.pop("scores")
    assert "scores" in e and "scores" not in out  # its own field sets
    # start_copy keeps the metainfo objects themselves
    out2 = mtc_loader.start_copy(e, "cpu").get()
    assert out2.scale is e.scale and out2.mask is e.mask and out2.tags is e.tags
    assert_bitwise(out2.boxes, e.boxes)


class UnknownBoxes:
    def __init__(self, t):
        self.t = t

    def __len__(self):
        return len(self.t)

    def to(self, device):
        return UnknownBoxes(self.t.to(device))


def test_unregistered_box_class_is_refused_by_path():
    gt = InstanceData(labels=torch.arange(2))
    gt.bboxes = UnknownBoxes(torch.rand(2, 7))
    with pytest.raises(TypeError, match=r"data\[1\]\['gt'\] \(a mmengine.structures.instance_data.InstanceData\)"
                                        r".*data field 'bboxes' .* holds a .*UnknownBoxes, which BaseDataElement.to "
                                        r"moves .* register it with mtc_loader.register_container"):
        mtc_loader.start_copy([0, {"gt": gt}], "cpu").get()


def test_bad_registrations_of_data_elements():
    with pytest.raises(ValueError, match="BaseDataElement is registered already"):
        mtc_loader.register_container(BaseDataElement, mm._elements._flatten_element, mm._elements._unflatten_element)
    with pytest.raises(TypeError, match=r"register_container\(.*WithExtras\): flatten must be callable"):
        mtc_loader.register_container(WithExtras, None, mm._elements._unflatten_element)  # type: ignore[arg-type]


def test_registered_names():
    assert FUNCTIONS.get("mtc_packed_collate") is mm.packed_collate
    assert MODELS.get("MTCDataPreprocessor") is mm.MTCDataPreprocessor
    assert LOOPS.get("MTCEpochBasedTrainLoop") is mm.MTCEpochBasedTrainLoop
    assert LOOPS.get("MTCIterBasedTrainLoop") is mm.MTCIterBasedTrainLoop
    mm.packed_collate.arm()
    state = pickle.loads(pickle.dumps(mm.packed_collate))  # what a spawn worker receives
    assert state.arena is mm.packed_collate.arena  # the same arena (this process holds it)


def test_import_mtc_loader_does_not_import_mmengine():
    code = "import sys, mtc_loader; assert 'mmengine' not in sys.modules; print('ok')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.stdout.strip() == "ok", r.stderr


def test_clear_import_error_without_mmengine():
    code = ("import sys; sys.modules['mmengine'] = None\n"
            "try:\n    import mtc_loader.mmengine\nexcept ImportError as e:\n    print(e)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "mtc_loader.mmengine needs mmengine (pip install mmengine)" in r.stdout, r.stderr


def test_file_tensor_in_a_data_field_is_read(tmp_path):
    """A FileTensor in a data element's data field is read like one in ``inputs``: through
    mtc_packed_collate (0 and 2 workers) and start_copy, the model gets the file's values."""
    values = np.arange(24, dtype=np.float32).reshape(6, 4)
    path = tmp_path / "boxes.bin"
    values.tofile(path)
    gt = BaseDataElement(metainfo={"idx": 0})
    gt.bboxes = mtc_loader.FileTensor(str(path), torch.float32, (6, 4))
    gt.labels = torch.arange(6)
    sample = {"inputs": mtc_loader.FileTensor(str(path), torch.float32, (6, 4)), "data_samples": gt}
    want = torch.from_numpy(values)
    out = mtc_loader.start_copy(gt, "cpu").get()
    assert type(out) is BaseDataElement and isinstance(out.bboxes, torch.Tensor)
    assert_bitwise(out.bboxes, want)
    out = mm.packed_collate([sample, sample]).unpack("cpu")
    for ds in out["data_samples"]:
        assert isinstance(ds.bboxes, torch.Tensor), type(ds.bboxes)
        assert_bitwise(ds.bboxes, want)
    assert all(isinstance(x, torch.Tensor) for x in out["inputs"])
    collate = mm.PackedPseudoCollate()
    collate.arm(32 << 20)
    dl = torch.utils.data.DataLoader([sample] * 4, batch_size=2, num_workers=2, collate_fn=collate)
    for batch in dl:
        for ds in batch.unpack("cpu")["data_samples"]:
            assert_bitwise(ds.bboxes, want)


@pytest.mark.parametrize("device", DEVICES)
def test_what_cast_data_leaves_on_the_host_stays_there(device):
    """Outside data samples, cast_data moves only tensors and data elements: a box object and a
    numpy array in ``inputs`` stay on the host as they are (packed or prefetched), while the
    lists of tensors in a data field stay on the host too, crossing in the packed region."""
    def sample(i):
        s = make_sample(i)
        s["inputs"]["boxes"] = LiDARBoxes(torch.rand(2, 7))
        s["inputs"]["calib"] = np.eye(3) * i
        s["data_samples"].cam_boxes = [torch.rand(2, 4), torch.rand(1, 4)]
        return s

    samples = [sample(i) for i in range(3)]
    ref = snapshot(BaseDataPreprocessor().to(device).cast_data(pseudo_collate(samples)))
    pre = mm.MTCDataPreprocessor(dict(type="BaseDataPreprocessor")).to(device)
    got = snapshot(pre.cast_data(mm.packed_collate(samples).to(device)))
    assert_same(ref, got)
    batch = pseudo_collate(samples)
    prefetched = next(iter(mm._loops._Prefetching([batch], torch.device(device), 1)))
    assert_same(ref, snapshot(pre.cast_data(prefetched)))
    assert isinstance(prefetched["inputs"]["calib"][1], np.ndarray)
    assert prefetched["inputs"]["boxes"][0] is batch["inputs"]["boxes"][0]  # start_copy: the same object


# ------------------------------------------------------------------------- the loops' figures in the logs

class TimedModel(BaseModel):
    """A step that takes ``step_s`` (a step-bound loop when the data is quick)."""

    def __init__(self, step_s: float = 0.0, data_preprocessor=None) -> None:
        super().__init__(data_preprocessor=data_preprocessor)
        self.w = torch.nn.Parameter(torch.ones(1))
        self.step_s = step_s

    def forward(self, inputs, data_samples=None, mode="tensor"):
        time.sleep(self.step_s)
        return {"loss": self.w.sum() * 0}


class SlowSamples(SlowLoading, Samples):
    """Samples that take ``sample_s`` each to load."""


_RUNS = iter(range(1 << 30))


def train_logged(tmp_path, device="cpu", *, loop="epoch", step_s=0.0, sample_s=0.0, window=3, **loop_cfg):
    """Two epochs of 3 batches (6 iterations of the iteration loop) with mmengine's LoggerHook
    writing every second iteration; the runner and the lines of its log file."""
    if loop == "epoch":
        train_cfg = dict(type="MTCEpochBasedTrainLoop", max_epochs=2, **loop_cfg)
    else:
        train_cfg = dict(type="MTCIterBasedTrainLoop", max_iters=6, **loop_cfg)
    name = f"logged{next(_RUNS)}"  # mmengine's logger and message hub are per experiment name
    with mock.patch("mmengine.runner.runner.get_device", return_value=device):
        runner = Runner(
            model=TimedModel(step_s), work_dir=str(tmp_path / name), experiment_name=name,
            train_dataloader=dict(dataset=SlowSamples(12 if loop == "epoch" else 40, sample_s), batch_size=4,
                                  sampler=dict(type="DefaultSampler", shuffle=False), num_workers=0),
            train_cfg=train_cfg, optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.01)),
            default_hooks=dict(checkpoint=None, logger=dict(type="LoggerHook", interval=2)),
            log_processor=dict(window_size=window, by_epoch=loop == "epoch"), log_level="INFO",
            env_cfg=dict(cudnn_benchmark=False, dist_cfg=dict(backend="gloo")), default_scope=None, cfg=dict(),
        )
        runner.train()
    with open(f"{runner.log_dir}/{runner.timestamp}.log") as f:
        return runner, f.read().splitlines()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loop", ["epoch", "iter"])
def test_loops_put_their_figures_in_the_log_lines(tmp_path, device, loop):
    """Each iteration the loop puts data_bound and data_wait_time in the message hub; mmengine's
    log lines show them next to its own data_time, which with these loops holds the loader's
    wait (the hooks between two iterations add to it)."""
    runner, lines = train_logged(tmp_path, device, loop=loop)
    hub = runner.message_hub
    bound, _ = hub.get_scalar("train/data_bound").data
    wait, counts = hub.get_scalar("train/data_wait_time").data
    data_time, _ = hub.get_scalar("train/data_time").data
    assert len(bound) == len(wait) == len(data_time) == 6
    # at the first iteration only its wait has been counted (the step after it comes next)
    assert bound[0] == 1.0 and ((bound[1:] > 0) & (bound[1:] < 1)).all(), bound
    assert (counts == 1).all() and (wait > 0).all(), wait
    # every batch's wait once: the loader's own count, in seconds
    stats = runner.train_loop.stats()
    assert stats["batches"] == 6
    assert wait.sum() == pytest.approx(stats["wait_ms"] / 1e3, rel=1e-9)
    assert (data_time >= wait - 1e-3).all(), (data_time, wait)
    logged = [line for line in lines if "(train)" in line]
    # every second iteration (of each epoch, with the epoch loop: the last of 3 is not logged)
    assert len(logged) == (2 if loop == "epoch" else 3), lines
    for line in logged:
        assert re.search(r"data_time: \d+\.\d{4}  ", line), line
        assert re.search(r"data_bound: 0\.\d{4}", line), line
        assert re.search(r"data_wait_time: \d+\.\d{4}", line), line


@pytest.mark.parametrize("bound", ["data", "step"])
def test_logged_data_bound_tells_which_side_waits(tmp_path, bound):
    """Slow samples and a quick step: the loop waits for data most of the time; a slow step and
    quick samples: hardly ever. The figure is over the log processor's window (3 iterations)."""
    slow = dict(sample_s=0.01) if bound == "data" else dict(step_s=0.04)
    runner, lines = train_logged(tmp_path, **slow)
    figures, _ = runner.message_hub.get_scalar("train/data_bound").data
    if bound == "data":
        assert figures[2:].min() > 0.6, figures
    else:
        assert figures[2:].max() < 0.4, figures


def test_loops_log_nothing_of_theirs_when_told(tmp_path):
    runner, lines = train_logged(tmp_path, log_stats=False)
    assert "train/data_bound" not in runner.message_hub.log_scalars
    assert "train/data_wait_time" not in runner.message_hub.log_scalars
    assert "train/data_time" in runner.message_hub.log_scalars  # mmengine's own, as ever
    assert not any("data_bound" in line for line in lines)
    with pytest.raises(TypeError, match="mtc_loader: log_stats must be True or False, got 'no'"):
        train_logged(tmp_path, loop="iter", log_stats="no")
    with pytest.raises(ValueError, match="mtc_loader: the prefetching train loop logs data_bound over the log "
                                         "processor's window_size, which must be an int >= 1, got 0"):
        train_logged(tmp_path, window=0)
