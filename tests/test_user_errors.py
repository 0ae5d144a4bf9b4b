"""The rough edges a new user meets first: errors that say what to do, and nothing that breaks a
program's DataLoader workers or changes its own settings.

CPU only (the CUDA half of the example runs where a GPU is, in examples/example.py itself).
"""
from __future__ import annotations

import copy
import importlib.util
import os
import pickle
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import mtc_loader
from mtc_loader import FileTensor, PackedCollate, _tree
from mtc_loader.prefetch._service import _SwitchInterval
from conftest import package_parent, subprocess_env

ROOT = Path(__file__).resolve().parents[1]


def _sparse():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note on sparse invariant checks
        return torch.sparse_coo_tensor([[0]], [1.0], (2,))


class Holder:
    """A registered container (module level: its registration pickles)."""

    def __init__(self, t):
        self.t = t


def _holder_flatten(h):
    return [h.t], None


def _holder_unflatten(values, context):
    h = Holder.__new__(Holder)
    h.t = values[0]
    return h


# ------------------------------------------------------ registrations carried to spawn workers

class Vanishing:
    """Stands for a class of the parent's __main__ that a spawn worker cannot find."""


def _vanishing_flatten(v):
    return [], None


def _vanishing_unflatten(values, context):
    return Vanishing()


def test_a_carried_registration_that_cannot_be_unpickled_is_skipped_and_said_once(monkeypatch):
    monkeypatch.setattr(_tree, "_UNCARRIED_WARNED", [], raising=False)
    mtc_loader.register_container(Vanishing, _vanishing_flatten, _vanishing_unflatten)
    mtc_loader.register_container(Holder, _holder_flatten, _holder_unflatten)
    try:
        blob = pickle.dumps(PackedCollate(list, arena_bytes=65536).containers)  # what a worker receives
        mtc_loader.unregister_container(Holder)
        mtc_loader.unregister_container(Vanishing)
        saved = globals().pop("Vanishing")  # the receiving process cannot find the class
        try:
            with pytest.warns(RuntimeWarning, match=r"could not receive 1 container registration.*"
                                                    r"test_user_errors\.Vanishing.*__main__"):
                carried = pickle.loads(blob)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                pickle.loads(blob)  # said once
        finally:
            globals()["Vanishing"] = saved
        assert carried is _tree.CARRIED
        # the others are installed
        assert _tree._registration(Holder) is not None
    finally:
        for cls in (Holder, Vanishing):
            if cls in _tree._REGISTRY:
                mtc_loader.unregister_container(cls)


SPAWN_MAIN = textwrap.dedent("""
    import torch, mtc_loader
    from torch.utils.data import DataLoader

    class Boxes:  # defined in __main__: a spawn worker cannot unpickle it
        def __init__(self, t):
            self.t = t

    def flatten(b):
        return [b.t], None

    def unflatten(values, context):
        b = Boxes.__new__(Boxes)
        b.t = values[0]
        return b

    mtc_loader.register_container(Boxes, flatten, unflatten)
    dl = DataLoader(list(range(4)), batch_size=2, num_workers=1, multiprocessing_context="spawn",
                    collate_fn=mtc_loader.PackedCollate(arena_bytes=1 << 20))
    out = [b.to("cpu") for b in dl]
    assert [x.tolist() for x in out] == [[0, 1], [2, 3]], out
    print("EPOCH OK")
""")


@pytest.mark.slow
def test_a_class_registered_in_main_does_not_break_spawn_workers():
    r = subprocess.run([sys.executable, "-c", SPAWN_MAIN], capture_output=True, text=True, timeout=240,
                       env=subprocess_env(), cwd=package_parent())
    assert r.returncode == 0 and "EPOCH OK" in r.stdout, r.stdout + r.stderr
    assert r.stderr.count("could not receive 1 container registration(s)") == 1, r.stderr
    assert "__main__.Boxes" in r.stderr


# ------------------------------------------------------------- names() that misbehave

@pytest.mark.parametrize("names", [lambda ctx: [], lambda ctx: 1 / 0, lambda ctx: [None]],
                         ids=["too-few", "raises", "not-str"])
def test_a_misbehaving_names_falls_back_to_positions(names):
    mtc_loader.register_container(Holder, _holder_flatten, _holder_unflatten, names=names)
    try:
        with pytest.raises(TypeError, match=r"^mtc_loader: data\[1\]\[0\] is a sparse tensor"):
            mtc_loader.start_copy([0, Holder(_sparse())], "cpu")
    finally:
        mtc_loader.unregister_container(Holder)


def test_names_still_name_the_children():
    mtc_loader.register_container(Holder, _holder_flatten, _holder_unflatten, names=lambda ctx: ["t"])
    try:
        with pytest.raises(TypeError, match=r"^mtc_loader: data\[1\]\.t is a sparse tensor"):
            mtc_loader.start_copy([0, Holder(_sparse())], "cpu")
    finally:
        mtc_loader.unregister_container(Holder)


# ------------------------------------------------------------------- FileTensor refusals

def test_a_directory_is_refused_with_is_a_directory_error(tmp_path):
    for make in (lambda: FileTensor(tmp_path, torch.uint8), lambda: FileTensor.npy(tmp_path),
                 lambda: FileTensor(tmp_path, torch.uint8, (-1, 2))):
        with pytest.raises(IsADirectoryError, match="mtc_loader: .* is a directory"):
            make()


@pytest.fixture
def unix_socket(tmp_path):
    path = tmp_path / "s.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    yield path
    s.close()


def test_a_unix_socket_is_refused_as_not_a_regular_file(unix_socket):
    for make in (lambda: FileTensor(unix_socket, torch.uint8), lambda: FileTensor.npy(unix_socket)):
        with pytest.raises(OSError, match="mtc_loader: .*not a regular file or block device") as ei:
            make()
        assert "No such device or address" not in str(ei.value)
    ft = FileTensor(unix_socket, torch.uint8, (4,))
    for read in (lambda: mtc_loader.start_copy([ft], "cpu").get(), lambda: PackedCollate(list, arena_bytes=65536)([ft])):
        with pytest.raises(OSError, match=r"mtc_loader: cannot read data\[0\] from .*: not a regular file or "
                                          r"block device \(a FileTensor is read at offsets\)") as ei:
            read()
        assert "No such device or address" not in str(ei.value)


@pytest.mark.parametrize("shape", [(2 ** 40, 2 ** 40, 0), (0, 2 ** 62, 4)])
def test_an_empty_shape_whose_dims_overflow_is_refused_at_construction(tmp_path, shape):
    f = tmp_path / "x.bin"
    f.write_bytes(b"")
    with pytest.raises(ValueError, match=r"mtc_loader: FileTensor .*holds no element.*2\*\*63 - 1"):
        FileTensor(f, torch.uint8, shape)
    ok = FileTensor(f, torch.uint8, (2 ** 40, 0))  # torch can make this one
    assert mtc_loader.start_copy(ok, "cpu").get().shape == (2 ** 40, 0)
    with pytest.raises(ValueError, match="mtc_loader: 4 stacked FileTensors .* hold no element"):
        FileTensor.stack([FileTensor(f, torch.uint8, (2 ** 62, 0))] * 4)


# -------------------------------------------------------- a received batch, copied or pickled

def test_a_batch_received_from_a_worker_refuses_deepcopy_and_pickle_clearly():
    pc = PackedCollate(arena_bytes=1 << 20)
    dl = DataLoader([{"x": torch.full((3,), float(i))} for i in range(4)], batch_size=2, num_workers=1,
                    multiprocessing_context="fork", collate_fn=pc)
    it = iter(dl)
    batch = next(it)
    for dup in (copy.deepcopy, pickle.dumps, copy.copy):
        with pytest.raises(RuntimeError, match="cannot be copied or pickled within the process that holds its "
                                               "region") as ei:
            dup(batch)
        assert "copy.deepcopy(batch.to(device))" in str(ei.value)
    assert batch.to("cpu")["x"].tolist() == [[0.0] * 3, [1.0] * 3]  # the batch itself is intact
    with pytest.raises(RuntimeError, match="cannot be copied or pickled"):
        copy.deepcopy(batch)  # consumed: still refused
    del it, batch
    import gc
    gc.collect()


# ----------------------------------------------------------------------- the switch interval

@pytest.fixture
def own_interval():
    saved = sys.getswitchinterval()
    yield
    sys.setswitchinterval(saved)


@pytest.mark.parametrize("program", [0.0071, 0.0002, 0.005, 0.0005])
def test_the_programs_switch_interval_comes_back_exactly(own_interval, program):
    sys.setswitchinterval(program)
    before = sys.getswitchinterval()
    s = _SwitchInterval()
    for _ in range(5):  # five batches
        s.enter(0.0005)
        assert sys.getswitchinterval() <= max(before, 0.0005)
        s.exit(0.0005)
        assert sys.getswitchinterval() == before


def test_an_epoch_leaves_the_switch_interval_as_it_was(own_interval):
    sys.setswitchinterval(0.0071)
    before = sys.getswitchinterval()
    assert [b.tolist() for b in mtc_loader.PrefetchLoader([torch.ones(2)] * 4, "cpu")] == [[1.0, 1.0]] * 4
    assert sys.getswitchinterval() == before


def test_two_loaders_at_once_work_at_the_shorter_interval(own_interval):
    # the generators run on the services' threads (produce_on_caller=False), where the
    # interval applies while a service works on a batch
    sys.setswitchinterval(0.005)
    a_working, b_done, seen = threading.Event(), threading.Event(), []

    def batches_a():  # loader a's service works on its batch until loader b is done
        a_working.set()
        b_done.wait(30)
        yield torch.ones(1)

    def batches_b():
        a_working.wait(30)
        seen.append(sys.getswitchinterval())
        yield torch.ones(1)

    out = []
    a = threading.Thread(target=lambda: out.extend(
        mtc_loader.PrefetchLoader(batches_a(), "cpu", gil_switch_interval=0.001, produce_on_caller=False)))
    a.start()
    try:
        out.extend(mtc_loader.PrefetchLoader(batches_b(), "cpu", gil_switch_interval=0.0002,
                                              produce_on_caller=False))
    finally:
        b_done.set()
        a.join(30)
    assert len(out) == 2
    assert seen[0] == pytest.approx(0.0002, abs=2e-6)
    assert sys.getswitchinterval() == 0.005


def test_two_services_at_once_get_the_shorter_interval(own_interval):
    sys.setswitchinterval(0.005)
    s = _SwitchInterval()
    s.enter(0.001)
    assert sys.getswitchinterval() == pytest.approx(0.001, abs=2e-6)
    s.enter(0.0002)  # the second loader's interval applies while both work
    assert sys.getswitchinterval() == pytest.approx(0.0002, abs=2e-6)
    s.exit(0.001)
    assert sys.getswitchinterval() == pytest.approx(0.0002, abs=2e-6)
    s.enter(0.001)
    s.exit(0.0002)
    assert sys.getswitchinterval() == pytest.approx(0.001, abs=2e-6)
    s.exit(0.001)
    assert sys.getswitchinterval() == 0.005


def test_a_program_change_during_an_epoch_is_kept(own_interval):
    sys.setswitchinterval(0.005)
    s = _SwitchInterval()
    s.enter(0.0005)
    sys.setswitchinterval(0.002)  # the program's own, meanwhile
    s.exit(0.0005)
    assert sys.getswitchinterval() == pytest.approx(0.002, abs=2e-6)


# --------------------------------------------------------------------- hints for mistakes

def test_indexing_a_packed_batch_points_to_to_and_prefetch():
    b = PackedCollate(arena_bytes=65536)([{"x": torch.ones(2)}])
    for use in (lambda: b["x"], lambda: b[0], lambda: [x for x in b]):
        with pytest.raises(TypeError, match=r"mtc_loader: a PackedBatch .*batch\.to\(device\).*PrefetchLoader"):
            use()
    assert b.to("cpu")["x"].tolist() == [[1.0, 1.0]]


def test_indexing_a_handle_points_to_get():
    h = mtc_loader.start_copy({"x": torch.ones(2)}, "cpu")
    for use in (lambda: h["x"], lambda: h[0], lambda: [x for x in h]):
        with pytest.raises(TypeError, match=r"mtc_loader: an AsyncCopyHandle .*handle\.get\(\)"):
            use()
    assert h.get()["x"].tolist() == [1.0, 1.0]


@pytest.mark.parametrize("device,meant", [("gpu", "cuda"), ("GPU:1", "cuda:1"), ("cuda0", "cuda:0")])
def test_a_gpu_device_name_gets_did_you_mean(device, meant):
    with pytest.raises(ValueError, match=f"did you mean '{meant}'") as ei:
        mtc_loader.start_copy([torch.ones(1)], device)
    assert "ipu" not in str(ei.value)  # not torch's list of every device type


def test_an_arena_filled_by_kept_batches_says_how_many_are_held():
    pc = PackedCollate(list, arena_bytes=4 * 65536, timeout=0.05)
    kept = [pc([torch.ones(4)]) for _ in range(4)]
    with pytest.raises(RuntimeError) as ei:
        pc([torch.ones(4)])
    msg = str(ei.value)
    assert f"4 batches (262144 bytes) are held by the training process (pid {os.getpid()}" in msg, msg
    assert "keeps the PackedBatch objects" in msg and "batch.to(device)" in msg, msg
    # the batch the loop unpacks takes one slot: the arena's size is not what is short
    assert "Its size is not what is short" in msg and "this arena has 262144" in msg, msg
    del kept


def test_ragged_samples_name_the_tensor_and_packed_collate_list():
    """default_collate cannot stack tensors that differ in shape (in a worker, torch's error is about
    a storage it cannot resize, or the sizes, and names neither the tensor nor the way out): the
    error names the tensor by its path in the sample and says to use PackedCollate(list)."""
    class Boxes(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"label": i, "cams": [{"boxes": torch.zeros(1 + i % 2, 4)}]}

    for workers in (0, 1):
        dl = DataLoader(Boxes(), batch_size=2, num_workers=workers, collate_fn=PackedCollate(arena_bytes=1 << 20))
        with pytest.raises(RuntimeError, match=r"default_collate cannot stack sample\['cams'\]\[0\]\['boxes'\] "
                                               r"across the batch: it has shape \[1, 4\] in sample 0 and \[2, 4\] "
                                               r"in sample 1.*PackedCollate\(list\)"):
            next(iter(mtc_loader.PrefetchLoader(dl, "cpu")))
    out = next(iter(mtc_loader.PrefetchLoader(
        DataLoader(Boxes(), batch_size=2, collate_fn=PackedCollate(list, arena_bytes=1 << 20)), "cpu")))
    assert [s["cams"][0]["boxes"].shape for s in out] == [(1, 4), (2, 4)]
    # a collate_fn of one's own that stacks ragged parts with default_collate: the shapes, and the way out
    with pytest.raises(RuntimeError, match=r"called by the collate_fn\) cannot stack tensors of shapes \[1\] "
                                           r"and \[2\].*PackedCollate\(list\)"):
        PackedCollate(_stack_firsts, arena_bytes=1 << 20)([[torch.zeros(1)], [torch.zeros(2)]])


def _stack_firsts(samples):
    return torch.utils.data.default_collate([s[0] for s in samples])


def _lambda_collate():
    return PackedCollate(lambda samples: samples, arena_bytes=65536)


def test_a_collate_fn_that_does_not_pickle_is_named_with_what_to_do():
    pc = _lambda_collate()
    with pytest.raises(Exception, match=r"mtc_loader: PackedCollate's collate_fn .*<lambda>.* cannot be pickled"
                                        r".*spawn or forkserver.*module's top level.*fork") as ei:
        pickle.dumps(pc)
    assert isinstance(ei.value, (pickle.PicklingError, AttributeError))
    pickle.loads(pickle.dumps(PackedCollate(list, arena=pc.arena)))  # a module-level one travels


class MovesItself:
    def __init__(self, t):
        self.t = t

    def to(self, device):
        return MovesItself(self.t.to(device))


def test_a_class_with_a_to_method_passed_through_is_warned_about_once():
    obj = MovesItself(torch.ones(2))
    with pytest.warns(UserWarning, match=r"test_user_errors\.MovesItself has a to\(\) method.*passed through"
                                         r".*register_container\(MovesItself"):
        out = mtc_loader.start_copy([obj, obj], "cpu").get()
    assert out[0] is obj
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mtc_loader.start_copy([obj], "cpu").get()  # once
        _tree._forget()  # even after the engine forgot the type
        mtc_loader.start_copy([obj], "cpu").get()
    mtc_loader.register_container(MovesItself, lambda m: ([m.t], None), lambda v, c: MovesItself(v[0]))
    try:
        assert mtc_loader.start_copy([obj], "cpu").get()[0] is not obj  # registered: walked, no warning
    finally:
        mtc_loader.unregister_container(MovesItself)


# ----------------------------------------------------------------------------- the examples

def _load_example(name):
    spec = importlib.util.spec_from_file_location(f"_example_{name}", ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_example_times_against_to_and_says_what_a_cpu_run_shows():
    ex = _load_example("example")
    batch = ex.create_batch_meta_data(batch_size=2)
    t_mtc, t_to = ex.time_against_to(batch, torch.device("cpu"), reps=3)
    assert t_mtc > 0 and t_to > 0
    if torch.cuda.is_available():
        pytest.skip("the no-GPU message is shown without a GPU")
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "example.py")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "reuse" not in r.stdout and "needs a GPU" in r.stdout, r.stdout
    # nothing was copied, and no CUDA context was made: the output says neither
    assert "copied" not in r.stdout and "CUDA context" not in r.stdout, r.stdout
    assert "528 tensors" in r.stdout and "returned as they are (already there: no copy)" in r.stdout, r.stdout


def test_the_profiling_example_uses_no_private_torch_module_and_gives_a_verdict():
    src = (ROOT / "examples" / "profile_prefetch.py").read_text()
    assert "torch._C" not in src and "torch._C" not in (ROOT / "docs" / "profiler.md").read_text()
    ex = _load_example("profile_prefetch")
    assert ex.all_threads_config() is not None  # this torch can profile every thread
    s = {"batches": 10, "wait_ms_per_batch": 5.0, "step_ms_per_batch": 5.0, "data_bound": 0.5,
         "service_cpu_ms_per_batch": 1.0}
    assert ex.verdict(s).startswith("DATA-BOUND")
    assert ex.verdict({**s, "data_bound": 0.01}).startswith("not data-bound")


def _import_source_copy(tmp_path, *extra_path):
    """Imports, in a fresh interpreter started in its parent folder, a copy of the package's
    Python sources without the built engine: a repository root after ``pip install .``. -S keeps
    site's path hooks (an editable install's) out; torch and numpy come from their folders."""
    import numpy
    src = tmp_path / "checkout"
    shutil.copytree(Path(mtc_loader.__file__).parent, src / "mtc_loader",
                    ignore=shutil.ignore_patterns("_engine*.so", "_engine*.pyd", "__pycache__"))
    deps = [os.path.dirname(os.path.dirname(m.__file__)) for m in (torch, numpy)]
    code = f"import sys; sys.path[1:1] = {[*extra_path, *deps]!r}; import mtc_loader"
    r = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=src)
    assert r.returncode != 0, r.stdout + r.stderr
    return r.stderr, str(src / "mtc_loader")


def test_a_source_folder_without_its_engine_says_it_hides_the_installed_package(tmp_path):
    err, here = _import_source_copy(tmp_path, package_parent())
    last = err.strip().splitlines()[-1]
    assert "circular import" not in err, err
    assert last.startswith("ImportError: mtc_loader was imported from the source folder"), err
    assert here in last and "not built" in last, err
    assert f"hides the installed mtc_loader in {os.path.join(package_parent(), 'mtc_loader')}" in last, err
    assert "Run Python from another folder" in last and "pip install -e ." in last, err


def test_a_source_folder_without_its_engine_says_how_to_build_it(tmp_path):
    err, here = _import_source_copy(tmp_path)
    last = err.strip().splitlines()[-1]
    assert "circular import" not in err, err
    assert here in last and "not built" in last and "build_ext --inplace" in last, err


def test_the_profiling_example_writes_its_trace_where_it_says_and_quiets_a_cuda_build_without_gpu(
        monkeypatch, tmp_path):
    ex = _load_example("profile_prefetch")
    monkeypatch.chdir(tmp_path)
    out = Path(ex.trace_path(["profile_prefetch.py"]))
    assert out.parent.is_dir() and tmp_path not in out.parents and out.parent != tmp_path
    assert ex.trace_path(["profile_prefetch.py", "t.json"]) == "t.json"
    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ex.quiet_cuda_build_without_gpu()
    assert os.environ["KINETO_LOG_LEVEL"] == "5"
    monkeypatch.setenv("KINETO_LOG_LEVEL", "1")  # the user's own setting stays
    ex.quiet_cuda_build_without_gpu()
    assert os.environ["KINETO_LOG_LEVEL"] == "1"
    monkeypatch.delenv("KINETO_LOG_LEVEL")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU: Kineto's log as it is
    ex.quiet_cuda_build_without_gpu()
    assert "KINETO_LOG_LEVEL" not in os.environ
    out.parent.rmdir()


def test_the_training_example_says_why_more_batches_were_packed_than_trained_on():
    note = _load_example("train_loop").packed_note
    assert note(30, 24, 2, 2, 2) == (
        "30 batches packed for 24 steps: the last 6 were packed ahead of the loop and not trained on when it "
        "stopped (the DataLoader's 2 workers keep up to 4 ready (prefetch_factor 2 each); PrefetchLoader holds "
        "up to 2, its depth)")
    assert "no workers" in note(26, 24, 0, None, 2)
    assert note(24, 24, 2, 2, 2) == "24 batches packed for 24 steps"


# --- tensors without data of their own: what each is, and what to do


class _Wrapper(torch.Tensor):
    """A wrapper tensor subclass (module level, as subclasses are): its data is ``elem``'s."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)

    def __init__(self, elem):
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{cls.__name__} has no {func}")


class _ShardedLike(_Wrapper):
    """DTensor's way out: the whole tensor."""

    def full_tensor(self):
        return self.elem


def _fake():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return FakeTensorMode().from_tensor(torch.ones(3))


def _freed():
    t = torch.ones(3)
    t.untyped_storage().resize_(0)
    return t


_WITHOUT_DATA = {
    "wrapper": (lambda: _Wrapper(torch.ones(3)),
                r"is a test_user_errors\._Wrapper, a wrapper tensor subclass \(with __torch_dispatch__, like "
                r"DTensor\).*convert it to a plain torch\.Tensor first"),
    "dtensor_like": (lambda: _ShardedLike(torch.ones(3)),
                     r"is a test_user_errors\._ShardedLike, a wrapper tensor subclass.*"
                     r"call \.full_tensor\(\) for the whole tensor \(or \.to_local\(\)"),
    "fake": (_fake, r"is a fake tensor \(made under FakeTensorMode.*has no data to copy: copy real tensors"),
    "functional": (lambda: torch._to_functional_tensor(torch.ones(3)),
                   r"is a functional tensor .*copy torch\._from_functional_tensor\(t\)"),
    "freed": (_freed, r"is a tensor whose storage was freed or shrunk \(it holds 0 bytes, the tensor's elements "
                      r"need 12; e\.g\. untyped_storage\(\)\.resize_\(0\)"),
}


@pytest.mark.parametrize("how", ["start_copy", "packed"])
@pytest.mark.parametrize("kind", sorted(_WITHOUT_DATA))
def test_a_tensor_without_data_of_its_own_says_what_it_is_and_what_to_do(kind, how):
    """They all said "cannot read the tensor at data['x']: None"."""
    make, what = _WITHOUT_DATA[kind]
    data = {"x": make(), "y": torch.ones(2)}
    msg = "no error"
    with warnings.catch_warnings():
        # a FakeTensor's data_ptr() warns before it fails (torch's deprecation of that access)
        warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor")
        try:
            if how == "start_copy":
                mtc_loader.start_copy(data, "cpu", use_background_thread=False).get()
            else:
                PackedCollate(list, arena_bytes=1 << 20)([data])
        except Exception as e:  # the message only: torch's repr of a freed tensor crashes
            msg = f"{type(e).__name__}: {e}"
    del data
    path = r"data\['x'\]" if how == "start_copy" else r"data\[0\]\['x'\]"
    assert re.match(r"TypeError: mtc_loader: " + path + " " + what, msg), msg


def test_a_dtensor_says_full_tensor_or_to_local():
    from conftest import run_child
    got = run_child("""
        import json, os, tempfile, warnings, torch, torch.distributed as dist
        dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard
        d = DTensor.from_local(torch.arange(4.0), init_device_mesh("cpu", (1,)), [Shard(0)])
        import mtc_loader
        out = []
        for fn in (lambda: mtc_loader.start_copy({"x": d}, "cpu", use_background_thread=False).get(),
                   lambda: mtc_loader.PackedCollate(list, arena_bytes=1 << 20)([{"x": d}])):
            try:
                fn()
            except TypeError as e:
                out.append(str(e))
        dist.destroy_process_group()
        print(json.dumps(out))
    """)
    assert len(got) == 2
    for msg, path in zip(got, ("data['x']", "data[0]['x']")):
        assert msg.startswith(f"mtc_loader: {path} is a torch.distributed.tensor.DTensor, a wrapper tensor subclass")
        assert "call .full_tensor() for the whole tensor (or .to_local() for this rank's shard)" in msg


def test_a_lazy_view_of_freed_storage_is_refused_before_it_is_resolved():
    """Resolving a conj/neg view reads its storage: over a freed one it would read freed memory
    (run in a child, so that a crash fails this test only)."""
    from conftest import run_child
    got = run_child("""
        import json, torch, mtc_loader
        z = torch.complex(torch.ones(3), torch.ones(3))
        conj = z.conj()
        neg = torch._neg_view(torch.ones(4))
        z.untyped_storage().resize_(0)
        neg.untyped_storage().resize_(0)
        out = []
        for t in (conj, neg):
            for fn in (lambda: mtc_loader.start_copy({"x": t}, "cpu", use_background_thread=False).get(),
                       lambda: mtc_loader.PackedCollate(list, arena_bytes=1 << 20)([{"x": t}])):
                try:
                    fn()
                    out.append("no error")
                except TypeError as e:
                    out.append(str(e))
        print(json.dumps(out))
    """)
    assert len(got) == 4
    for msg, (path, need) in zip(got, [("data['x']", 24), ("data[0]['x']", 24), ("data['x']", 16),
                                       ("data[0]['x']", 16)]):
        assert msg.startswith(f"mtc_loader: {path} is a tensor whose storage was freed or shrunk (it holds 0 "
                              f"bytes, the tensor's elements need {need};"), msg


_SHRUNK = """
import json, torch, mtc_loader
from mtc_loader import _engine
ROUTE = {route!r}
if ROUTE != "shim":
    _engine._use_shim_reader(False)
if ROUTE == "attributes":
    _engine._use_dlpack(False)
def shrunk(view):
    t = torch.ones(4 << 20, dtype=torch.uint8)
    v = t[8:1 << 20] if view else t  # a view over the bytes the shrink takes away
    t.untyped_storage().resize_(16)
    return v
calls = {{
    "pack": lambda x: mtc_loader.PackedCollate(list, arena_bytes=16 << 20)([{{"x": x}}]).unpack(),
    "start_copy": lambda x: mtc_loader.start_copy({{"x": x}}, "cpu", use_background_thread=False).get(),
    "prefetch": lambda x: next(iter(mtc_loader.PrefetchLoader([{{"x": x}}], "cpu"))),
}}
out = []
for view in (False, True):
    for name, call in calls.items():
        try:
            call(shrunk(view))
            out.append([name, view, "no error"])
        except TypeError as e:
            out.append([name, view, str(e)])
# the check refuses nothing whole: a view at the storage's end, one element, an expanded view
base = torch.arange(64, dtype=torch.float32)
fine = {{"end": base[60:], "one": base[63:], "expanded": base[:1].expand(1000), "strided": base[3::4]}}
got = mtc_loader.start_copy(fine, "cpu", use_background_thread=False).get()
packed = mtc_loader.PackedCollate(list, arena_bytes=1 << 20)([fine]).unpack()[0]
same = all(torch.equal(got[k], v) and torch.equal(packed[k], v) for k, v in fine.items())
print(json.dumps({{"out": out, "same": same, "reader": mtc_loader.output_maker()["reader"]}}))
"""


@pytest.mark.parametrize("route", ["shim", "dlpack", "attributes"])
def test_a_shrunk_storage_is_refused_on_every_reader_route(route):
    """untyped_storage().resize_(16) under a 4 MiB tensor (or a view of it): packed, copied or
    prefetched, the tensor is refused with a TypeError naming it, on every leaf reader (the
    shim's getters, DLPack, the attributes), instead of being read past its storage's end (a
    crash or garbage). Tensors within their storage are copied as before (run in a child)."""
    from conftest import run_child
    from mtc_loader import _engine
    parts = _engine._shim_parts()
    if route == "shim" and not parts["reader"] or route == "dlpack" and not parts["dlpack"]:
        pytest.skip(f"this torch offers no {route} reader")
    got = run_child(_SHRUNK.format(route=route))
    assert got["reader"] == route and got["same"]
    assert len(got["out"]) == 6
    for name, view, msg in got["out"]:
        path = "data[0]['x']" if name == "pack" else "data['x']"
        need = 1 << 20 if view else 4 << 20
        assert msg.startswith(f"mtc_loader: {path} is a tensor whose storage was freed or shrunk (it holds 16 "
                              f"bytes, the tensor's elements need {need};"), (name, view, msg)


@pytest.mark.cuda
def test_a_shrunk_cuda_storage_is_refused():
    """The same for a CUDA tensor, copied to the host and packed on the GPU's way."""
    from conftest import run_child
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    got = run_child("""
        import json, torch, mtc_loader
        out = []
        for target in ("cpu", "cuda"):
            t = torch.ones(1 << 20, dtype=torch.uint8, device="cuda")
            t.untyped_storage().resize_(16)
            try:
                mtc_loader.start_copy({"x": t}, target).get()
                out.append("no error")
            except TypeError as e:
                out.append(str(e))
        print(json.dumps(out))
    """)
    assert len(got) == 2
    for msg in got:
        assert msg.startswith("mtc_loader: data['x'] is a tensor whose storage was freed or shrunk (it holds 16 "
                              "bytes, the tensor's elements need 1048576;"), msg
