"""Shared fixtures and helpers of the test suite."""
from __future__ import annotations

import os
import random
import signal

import numpy as np
import pytest
import torch

# A background job of a non-interactive shell (`(cmd &)`, `nohup cmd &` in a script) starts with
# SIGINT ignored, and so does every process it starts: Ctrl-C would then never reach the tests
# that check what it does (a KeyboardInterrupt in get(), in a full arena's wait, in a prefetched
# loop), which would fail as if the package ignored it. The runner takes Python's own handler
# back; the processes it starts then get the default disposition, as from a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

HAS_CUDA = torch.cuda.is_available()
N_GPUS = torch.cuda.device_count() if HAS_CUDA else 0

if os.environ.get("MTC_TEST_INSTALLED"):
    # .ci/run's wheel check: the tests must exercise the installed wheel, not the source tree
    import mtc_loader
    if "site-packages" not in mtc_loader.__file__:
        raise RuntimeError(f"mtc_loader: MTC_TEST_INSTALLED is set but mtc_loader comes from {mtc_loader.__file__}")


def package_parent() -> str:
    """The sys.path entry the mtc_loader under test comes from: the source tree, or the
    site-packages of the installed wheel (MTC_TEST_INSTALLED)."""
    import mtc_loader
    return os.path.dirname(os.path.dirname(os.path.abspath(mtc_loader.__file__)))


def subprocess_env() -> dict:
    """The environment of a fresh interpreter a test starts: it imports the mtc_loader under
    test (run it with cwd=package_parent(), since ``python -c`` puts the working directory
    first on sys.path)."""
    return dict(os.environ, PYTHONPATH=package_parent() + os.pathsep + os.environ.get("PYTHONPATH", ""))


def run_child(code: str, **env: str) -> dict:
    """Runs ``code`` in a fresh interpreter that sees none of this process's MTC_* variables but
    ``env``, and returns the JSON object its last line of output prints."""
    import json
    import subprocess
    import sys
    import textwrap

    e = {k: v for k, v in subprocess_env().items() if not k.startswith("MTC_") or k == "MTC_TEST_INSTALLED"}
    e.update(env)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=package_parent(), env=e,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(autouse=True)
def _torch_settings_restored():
    """A test that trains through mmengine's Runner in this process (``randomness=dict(
    deterministic=True)``) turns torch's deterministic mode on process-wide; every later test
    starts with the settings the session had (deterministic mode fills new memory, which torch
    cannot do for every dtype)."""
    import torch.utils.deterministic as deterministic

    det, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = deterministic.fill_uninitialized_memory
    cudnn = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    yield
    torch.use_deterministic_algorithms(det, warn_only=warn)
    deterministic.fill_uninitialized_memory = fill
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = cudnn


@pytest.fixture(scope="session", autouse=True)
def _pread_fallback_warning(tmp_path_factory):
    """Where FileTensor reads fall back to pread without being asked to (a build without
    liburing, or io_uring that cannot be set up here), the process's first read warns once
    (a RuntimeWarning that says why, docs/files.md). The session expects that warning here, from
    one read, so that it is asserted once rather than failing whichever test reads a file first.
    Every other warning stays an error. (tests/test_files.py checks the warning's text, and that
    io_uring and MTC_FILE_READER=pread give none, in fresh processes.)"""
    import mtc_loader
    from mtc_loader import FileTensor, _engine

    mode, _why, forced, _liburing = _engine.file_reader()
    if mode == "pread" and not forced:
        path = tmp_path_factory.mktemp("reader") / "probe.bin"
        np.arange(16, dtype=np.uint8).tofile(path)
        with pytest.warns(RuntimeWarning, match="read with pread on helper threads, not io_uring"):
            out = mtc_loader.start_copy([FileTensor(path, torch.uint8)], "cpu").get()
        assert torch.equal(out[0], torch.arange(16, dtype=torch.uint8))
    yield


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fenced_block(text: str, after: str, lang: str = "python") -> str:
    """The first fenced code block in ``lang`` after the first occurrence of ``after`` in a
    markdown text (its lines, without the fences)."""
    start = text.index(after)
    opening = text.index(f"```{lang}\n", start) + len(lang) + 4
    return text[opening:text.index("```", opening)]


def mmengine_switch_lines() -> tuple[str, str]:
    """The child config the README's OpenMMLab paragraph shows, as (its ``_base_`` line, the
    lines of the switch): what a test writes under a base of its own."""
    with open(os.path.join(ROOT, "README.md")) as f:
        block = fenced_block(f.read(), "With OpenMMLab's mmengine")
    base, _, lines = block.partition("\n")
    assert base.startswith("_base_ = "), block
    return base, lines


requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
requires_2gpus = pytest.mark.skipif(N_GPUS < 2, reason="needs two CUDA GPUs")


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of t's values in row-major order, on the CPU."""
    t = t.detach().resolve_conj().resolve_neg().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def assert_bitwise(out, ref, where: str = "") -> None:
    """out equals ref bitwise: same type, dtype, shape, device and bytes."""
    assert isinstance(out, torch.Tensor), f"{where}: {type(out)} is not a tensor"
    assert out.dtype == ref.dtype, f"{where}: dtype {out.dtype} != {ref.dtype}"
    assert out.shape == ref.shape, f"{where}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert out.device == ref.device, f"{where}: device {out.device} != {ref.device}"
    assert torch.equal(as_bytes(out), as_bytes(ref)), f"{where}: bytes differ"


def assert_tree_bitwise(out, ref, where: str = "data") -> None:
    """Walks two structures; tensors compared bitwise, other leaves by identity or equality."""
    if isinstance(ref, torch.Tensor):
        assert_bitwise(out, ref, where)
    elif isinstance(ref, np.ndarray):
        assert type(out) is np.ndarray, f"{where}: {type(out)} is not a numpy array"
        assert out.dtype == ref.dtype and out.shape == ref.shape, f"{where}: {out.dtype} {out.shape} != {ref.dtype} {ref.shape}"
        assert out.tobytes() == ref.tobytes(), f"{where}: bytes differ"
    elif isinstance(ref, dict):
        assert type(out) is type(ref), f"{where}: {type(out)} != {type(ref)}"
        assert list(out.keys()) == list(ref.keys()), f"{where}: keys differ"
        for k in ref:
            assert_tree_bitwise(out[k], ref[k], f"{where}[{k!r}]")
    elif isinstance(ref, (list, tuple)):
        assert type(out) is type(ref), f"{where}: {type(out)} != {type(ref)}"
        assert len(out) == len(ref), f"{where}: length differs"
        for i, (o, r) in enumerate(zip(out, ref)):
            assert_tree_bitwise(o, r, f"{where}[{i}]")
    else:
        assert out is ref or out == ref, f"{where}: {out!r} != {ref!r}"


def tree_to(data, device, keep_numpy=False):
    """The reference: per-tensor .to(device), numpy leaves through torch.from_numpy (start_copy's
    conversion), or kept as they are (``keep_numpy``: a packed or prefetched batch)."""
    if isinstance(data, np.ndarray):
        return data if keep_numpy else torch.from_numpy(np.ascontiguousarray(data)).to(device)
    if isinstance(data, torch.Tensor):
        return data.to(device)
    if isinstance(data, dict):
        return type(data)((k, tree_to(v, device, keep_numpy)) for k, v in data.items())
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(tree_to(v, device, keep_numpy) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(tree_to(v, device, keep_numpy) for v in data)
    return data


def tree_kept(data, device):
    """The reference of a packed or prefetched batch: tensors moved, numpy arrays kept."""
    return tree_to(data, device, keep_numpy=True)


def seed_sample(rng: random.Random, g: torch.Generator) -> dict:
    """One sample of the reference multi-camera meta-data of example.txt (33 tensors).
    (tests/fuzz/make_corpus.py builds its layout seeds from it too.)"""
    cams = []
    for _ in range(6):
        n = rng.randint(10, 120)
        cams.append({
            "bounding_boxes": torch.rand(n, 4, generator=g),
            "class_ids": torch.randint(0, 10, (n,), generator=g),
            "active": torch.rand(n, generator=g) > 0.5,
            "depths": torch.rand(n, generator=g) * 80,
            "proj_mat": torch.rand(3, 4, generator=g),
        })
    n = rng.randint(10, 120)
    return {"cams_gt": cams, "gt_data": {
        "bounding_boxes_3d": torch.rand(n, 7, generator=g),
        "class_ids": torch.randint(0, 10, (n,), generator=g),
        "active": torch.rand(n, generator=g) > 0.5,
    }}


def seed_batch(n_samples: int, seed: int = 0, device: str = "cpu"):
    """The reference batch of example.txt: n_samples dicts, 33 tensors each."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = [seed_sample(rng, g) for _ in range(n_samples)]
    if device != "cpu":
        out = tree_to(out, device)
    return out


def random_tensor(dtype: torch.dtype, shape, gen: torch.Generator) -> torch.Tensor:
    """Random bytes reinterpreted as dtype (covers NaN payloads, every bit pattern)."""
    n = 1
    for s in shape:
        n *= s
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw & 1
    return raw.view(dtype).reshape(shape)


def random_array(dtype: np.dtype, shape, rng: np.random.Generator) -> np.ndarray:
    """Random bytes as a numpy array of dtype (every bit pattern; bool stays 0/1)."""
    n = int(np.prod(shape, dtype=np.int64))
    raw = rng.integers(0, 256, size=n * dtype.itemsize, dtype=np.uint8)
    if dtype.kind == "b":
        raw &= 1
    return raw.view(dtype).reshape(shape)


# ----------------------------------------------------------------- C builds (tests/c, tests/fuzz)

def c_compiler():
    """The C compiler make will use ($CC, cc, gcc or clang), or None."""
    import shutil
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc.split()[0])  # CC may carry arguments ("ccache gcc")
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def c_build_skip(what: str):
    """A pytest skipif mark for tests that build `what` with make and a C compiler."""
    import shutil
    reason = None
    if shutil.which("make") is None:
        reason = f"`make` not found on PATH; cannot build {what}"
    elif c_compiler() is None:
        reason = f"no C compiler found (tried $CC, cc, gcc, clang); cannot build {what}"
    return pytest.mark.skipif(reason is not None, reason=reason or "")


_CONFIG: list = []  # the session's pytest config (pytest_configure), for progress()


def pytest_configure(config):
    _CONFIG[:] = [config]
    # the process tests/exit_trap.c watches (when preloaded): the runner, until it ends
    os.environ["MTC_EXIT_TRAP_PID"] = str(os.getpid())


def pytest_unconfigure(config):
    os.environ.pop("MTC_EXIT_TRAP_PID", None)


# The runner's own pid. Tests fork (os.fork, DataLoader workers) and the children end with
# os._exit; should the runner itself call it (a child's path taken in the parent), the session
# would end with no summary and its output captured: the call is reported on the terminal first,
# with every thread's stack and the test that was running.
_RUNNER = os.getpid()
_os_exit = os._exit


def _exit_reported(code: int) -> None:
    if os.getpid() == _RUNNER:
        import sys
        import traceback
        try:
            lines = [f"tests: os._exit({code}) in the test runner (pid {_RUNNER}) during "
                     f"{os.environ.get('PYTEST_CURRENT_TEST', 'no test')}"]
            for tid, frame in sys._current_frames().items():
                lines.append(f"-- thread {tid}\n{''.join(traceback.format_stack(frame))}")
            config = _CONFIG[0] if _CONFIG else None
            capture = config and config.pluginmanager.getplugin("capturemanager")
            if capture is not None:
                with capture.global_and_fixture_disabled():
                    sys.stderr.write("\n".join(lines) + "\n")
                    sys.stderr.flush()
            else:
                sys.stderr.write("\n".join(lines) + "\n")
                sys.stderr.flush()
        except BaseException:
            pass
    _os_exit(code)


os._exit = _exit_reported


_TERMINAL_STDERR: list = []


def terminal_stderr() -> int:
    """A descriptor of the runner's own stderr, the terminal's, which pytest's capture does not
    redirect: for what must be seen even where the run ends before pytest shows the captured
    output (faulthandler's dump of a hung test that then ends the run). Outside a pytest run,
    or without its capture, stderr's descriptor."""
    if not _TERMINAL_STDERR:
        config = _CONFIG[0] if _CONFIG else None
        capture = config and config.pluginmanager.getplugin("capturemanager")
        if capture is not None:
            with capture.global_and_fixture_disabled():
                _TERMINAL_STDERR.append(os.dup(2))
        else:
            _TERMINAL_STDERR.append(os.dup(2))
    return _TERMINAL_STDERR[0]


def progress(line: str) -> None:
    """Writes ``line`` to the terminal at once, while the test runs and its output is captured,
    as pytest's live logging does: for the tests that run for minutes (the C unit tests and
    fuzz harnesses under sanitizers), so that a run does not look stuck. Nothing under -qq."""
    config = _CONFIG[0] if _CONFIG else None
    reporter = config and config.pluginmanager.getplugin("terminalreporter")
    capture = config and config.pluginmanager.getplugin("capturemanager")
    if not reporter or config.option.verbose < -1:
        return
    if capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(line)
    else:
        reporter.write_line(line)


def run_make(directory, *args, timeout: float) -> str:
    """Runs make in `directory`; fails the test with the output (its tail) on an error or a
    timeout. Returns the output. The Makefiles' ``== ...`` lines (a step starts) are shown as
    they come, with the time since make started."""
    import subprocess
    import threading
    import time
    cmd = ["make", "-C", str(directory), *args]
    env = dict(os.environ)
    env.setdefault("CC", c_compiler())
    t0 = time.monotonic()
    where = os.path.relpath(str(directory), ROOT)
    progress(f"\n  make -C {where} {' '.join(args)}: building, then running (minutes on 2 cores)")
    lines: list = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          errors="replace") as proc:

        def read() -> None:
            for line in proc.stdout:
                lines.append(line)
                if line.startswith("== "):
                    progress(f"  [{time.monotonic() - t0:4.0f} s] {line.rstrip()}")

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            reader.join(10)
            pytest.fail(f"{' '.join(cmd)} timed out after {timeout} s\n{''.join(lines)[-20000:]}")
        reader.join(60)
    out = "".join(lines)
    print(out)  # shown with -s / -rA, and in the failure report
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} exited with {proc.returncode}\n----- output (tail) -----\n{out[-20000:]}")
    return out


def pytest_collection_modifyitems(config, items):
    """Every test that needs CUDA carries the ``cuda`` marker, so ``pytest -m cuda`` (the GPU
    machine's run) cannot leave one out: tests decorated with ``requires_cuda`` alone get it."""
    for item in items:
        if any(m.name == "skipif" and "needs a CUDA GPU" in str(m.kwargs.get("reason", ""))
               for m in item.iter_markers()):
            item.add_marker(pytest.mark.cuda)
