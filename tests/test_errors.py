"""Errors of start_copy: the documented exception, a message naming the leaf by its path,
and an engine that keeps working afterwards.

Runs everywhere (no GPU needed): every error here is raised by ``start_copy`` itself
(bad arguments, leaves that cannot be copied), before any copy starts.
"""
from __future__ import annotations

import collections
import dataclasses
import time
import warnings

import numpy as np
import pytest
import torch

import mtc_loader
from mtc_loader import PackedCollate, start_copy

PATH = "data[1]['x'][0]"


def _in_path(leaf):
    """leaf placed at data[1]['x'][0]."""
    return ["first", {"x": [leaf, torch.ones(1)], "y": np.ones(2)}, np.arange(3)[::-1]]


def _quiet(fn):
    """Builds an exotic tensor without torch's beta / deprecation warnings (errors here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn()


def _jobs_in_flight(s):
    return s["jobs_submitted"] + s.get("jobs_inline", 0) - s["jobs_done"]


def _assert_engine_works():
    """A follow-up copy succeeds and every started job finishes."""
    a = np.arange(12, dtype=np.float32).reshape(3, 4)[::-1]
    out = start_copy({"a": [a], "s": "x"}, "cpu").get()
    assert torch.equal(out["a"][0], torch.from_numpy(np.ascontiguousarray(a)))
    assert out["s"] == "x"
    deadline = time.monotonic() + 20
    while True:
        s = mtc_loader.stats()
        if _jobs_in_flight(s) == 0:
            break
        assert time.monotonic() < deadline, f"jobs never settled: {s}"
        time.sleep(0.01)


@pytest.fixture(autouse=True)
def engine_still_works():
    yield
    _assert_engine_works()


# --------------------------------------------------------------------------- devices

@pytest.mark.parametrize("device", ["cuda:x", "foo", "mps", "cuda:-1", "cpu:x", ""])
def test_invalid_device_strings(device):
    with pytest.raises(ValueError) as ei:
        start_copy([torch.ones(1)], device)
    assert repr(device) in str(ei.value), str(ei.value)


@pytest.mark.parametrize("device", ["cpu", "cpu:0", torch.device("cpu"), torch.device("cpu", 0)],
                         ids=str)
def test_valid_cpu_devices(device):
    t = torch.ones(2)
    assert start_copy([t], device).get()[0] is t


@pytest.mark.parametrize("device", [torch.device("mps"), torch.device("meta"),
                                    torch.device("xla")], ids=str)
def test_unsupported_device_objects(device):
    with pytest.raises(ValueError, match=device.type):
        start_copy([torch.ones(1)], device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3", torch.device("cuda")], ids=str)
def test_cuda_unavailable(device):
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        start_copy([torch.ones(1), np.ones(2)], device)


def test_device_type_error_for_non_device():
    with pytest.raises((ValueError, TypeError)):
        start_copy([torch.ones(1)], 1.5)
    with pytest.raises((ValueError, TypeError)):
        start_copy([torch.ones(1)], None)


# --------------------------------------------------------------------------- options

@pytest.mark.parametrize("name", ["min_packed_alignment_bytes", "max_packed_chunk_bytes"])
@pytest.mark.parametrize("value,exc", [(0, ValueError), (-1, ValueError), (-4096, ValueError),
                                       (1.5, TypeError), (True, TypeError), (False, TypeError),
                                       ("16", TypeError), (None, TypeError), (16.0, TypeError)],
                         ids=repr)
def test_bad_int_options(name, value, exc):
    with pytest.raises(exc, match=name):
        start_copy([np.ones(2)], "cpu", **{name: value})


@pytest.mark.parametrize("name", ["min_packed_alignment_bytes", "max_packed_chunk_bytes"])
@pytest.mark.parametrize("value,exc", [(0, ValueError), (-1, ValueError), ("16", TypeError), (1.5, TypeError),
                                       (True, TypeError), (None, TypeError)], ids=repr)
@pytest.mark.parametrize("how", ["start_copy", "method"])
def test_bad_int_options_of_a_packed_batch(name, value, exc, how):
    """start_copy of a PackedBatch (and its own start_copy) checks the options as for any other
    structure, before the batch is consumed: it unpacks afterwards."""
    from mtc_loader import PackedCollate
    batch = PackedCollate(list, arena_bytes=1 << 20)([{"x": torch.arange(3)}])
    with pytest.raises(exc, match=name):
        if how == "start_copy":
            start_copy(batch, "cpu", **{name: value})
        else:
            batch.start_copy("cpu", **{name: value})
    assert torch.equal(start_copy(batch, "cpu", **{name: 8}).get()[0]["x"], torch.arange(3))


def test_unknown_keyword_and_positional_options():
    with pytest.raises(TypeError):
        start_copy([], "cpu", pack=True)
    with pytest.raises(TypeError):
        start_copy([], "cpu", True)


# --------------------------------------------------------------------------- cycles

def test_list_contains_itself():
    lst = [np.ones(2), "a"]
    lst.append(lst)
    with pytest.raises(ValueError, match="contains itself") as ei:
        start_copy(lst, "cpu")
    assert "data[2]" in str(ei.value)


def test_dict_contains_itself():
    d = {"a": np.ones(2), "inner": {}}
    d["inner"]["back"] = d
    with pytest.raises(ValueError, match="contains itself") as ei:
        start_copy([d], "cpu")
    assert "data[0]['inner']['back']" in str(ei.value)


def test_cycle_through_tuple_and_subclasses():
    lst = []
    lst.append((lst,))
    with pytest.raises(ValueError, match="contains itself"):
        start_copy(lst, "cpu")

    class L(list):
        pass

    sub = L([1])
    sub.append({"k": sub})
    with pytest.raises(ValueError, match="contains itself"):
        start_copy(sub, "cpu")


# --------------------------------------------------------------------------- bad tensors

def _coo():
    i = torch.tensor([[0, 1], [1, 0]])
    return torch.sparse_coo_tensor(i, torch.tensor([1.0, 2.0]), (2, 2))


BAD_TENSORS = {
    "sparse_coo": (lambda: _coo(), "sparse"),
    "sparse_csr": (lambda: _coo().to_dense().to_sparse_csr(), "sparse"),
    "sparse_csc": (lambda: _coo().to_dense().to_sparse_csc(), "sparse"),
    "nested_strided": (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested"),
    "nested_jagged": (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)],
                                                         layout=torch.jagged), "nested"),
    "quantized": (lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8), "quantized"),
    "quantized_quint8": (lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8),
                         "quantized"),
    "meta": (lambda: torch.empty(3, 2, device="meta"), "meta"),
}


@pytest.mark.parametrize("kind", list(BAD_TENSORS))
def test_bad_tensors_name_their_path(kind):
    make, what = BAD_TENSORS[kind]
    leaf = _quiet(make)
    with pytest.raises(TypeError, match=what) as ei:
        start_copy(_in_path(leaf), "cpu")
    assert PATH in str(ei.value), str(ei.value)


@pytest.mark.parametrize("kind", ["sparse_coo", "quantized", "meta"])
def test_bad_tensor_as_whole_data(kind):
    make, what = BAD_TENSORS[kind]
    with pytest.raises(TypeError, match=what) as ei:
        start_copy(_quiet(make), "cpu")
    assert "data " in str(ei.value) or str(ei.value).startswith("mtc_loader: data"), str(ei.value)


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=str)
def test_nested_tensor_is_named_nested_with_what_to_do(layout):
    """A nested tensor (a jagged one has layout torch.jagged) is refused as nested, not as a
    sparse tensor, with the ways to pass it: its components, or one padded tensor."""
    nt = _quiet(lambda: torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)], layout=layout))
    for run in (lambda: start_copy(_in_path(nt), "cpu"),
                lambda: PackedCollate(collate_fn=lambda s: s[0], arena_bytes=1 << 20)([_in_path(nt)])):
        with pytest.raises(TypeError) as ei:
            run()
        msg = str(ei.value)
        assert PATH in msg and " is a nested tensor" in msg, msg
        assert "sparse" not in msg and ".to_dense()" not in msg, msg
        assert "unbind()" in msg and "to_padded_tensor" in msg, msg


def test_zero_size_meta_tensor():
    with pytest.raises(TypeError, match="meta") as ei:
        start_copy(_in_path(torch.empty(0, 3, device="meta")), "cpu")
    assert PATH in str(ei.value)


# --------------------------------------------------------------------------- bad arrays

# numeric arrays that cannot become tensors (arrays of strings, bytes, objects, records and dates
# pass through: tests/test_string_arrays.py)
BAD_ARRAYS = {
    "big_endian_f4": (lambda: np.arange(3, dtype=">f4"), "byte order"),
    "big_endian_i8": (lambda: np.arange(3, dtype=">i8"), "byte order"),
    "longdouble": (lambda: np.zeros(2, dtype=np.longdouble), r"dtype float128 \(<f16\), for which torch has no "
                   r"dtype; convert it to one torch has first \(e.g. arr.astype\(np.float64\)\)"),
    "clongdouble": (lambda: np.zeros(2, dtype=np.clongdouble), r"dtype complex256 \(<c32\).*np.complex128"),
}


@pytest.mark.parametrize("kind", list(BAD_ARRAYS))
def test_bad_arrays_name_their_path(kind):
    make, what = BAD_ARRAYS[kind]
    with pytest.raises(TypeError, match=what) as ei:
        start_copy(_in_path(make()), "cpu")
    assert PATH in str(ei.value), str(ei.value)


def test_bad_array_views_name_their_path():
    # byte-swapped and float128 arrays fail whatever their strides or flags
    a = np.arange(12, dtype=">f8").reshape(3, 4)[::-1, ::2]
    with pytest.raises(TypeError, match="byte order") as ei:
        start_copy(_in_path(a), "cpu")
    assert PATH in str(ei.value)
    o = np.zeros((3, 4), dtype=np.longdouble).T
    o.flags.writeable = False
    with pytest.raises(TypeError, match="float128") as ei:
        start_copy(_in_path(o), "cpu")
    assert PATH in str(ei.value)


# --------------------------------------------------------------------------- paths

NT = collections.namedtuple("NT", "a b")


@dataclasses.dataclass
class DC:
    x: object


def test_paths_through_every_container_kind():
    bad = np.zeros(1, dtype=np.longdouble)
    cases = [
        ([NT(1, [bad])], "data[0].b[0]"),
        ({"k": DC(x=bad)}, "data['k'].x"),
        ({(1, "a"): bad}, "data[(1, 'a')]"),
        ({3: {None: bad}}, "data[3][None]"),
        (collections.OrderedDict(z=[0, bad]), "data['z'][1]"),
        ((0, (1, (2, bad))), "data[1][1][1]"),
        (bad, "data"),
    ]
    for data, path in cases:
        with pytest.raises(TypeError) as ei:
            start_copy(data, "cpu")
        msg = str(ei.value)
        assert f"{path} is a numpy array" in msg, (path, msg)


def test_path_at_depth_1000():
    root = cur = []
    for _ in range(999):
        nxt = []
        cur.append(nxt)
        cur = nxt
    cur.append(np.arange(2, dtype=">i4"))
    with pytest.raises(TypeError, match="byte order") as ei:
        start_copy(root, "cpu")
    assert "data" + "[0]" * 1000 + " " in str(ei.value)


def test_first_bad_leaf_is_reported_and_good_leaves_before_it_are_fine():
    data = [np.ones(3)[::-1], np.ones((2, 2)).T, {"bad": np.zeros(1, dtype=np.longdouble)},
            np.arange(3, dtype=">u2")]
    with pytest.raises(TypeError) as ei:
        start_copy(data, "cpu")
    assert "data[2]['bad']" in str(ei.value)


# --------------------------------------------------------------------------- not errors

def test_lazily_conjugated_and_negated_are_not_errors():
    g = torch.Generator().manual_seed(41)
    z = torch.randn(5, 3, dtype=torch.complex128, generator=g)
    data = {"conj": z.conj(), "neg": z.conj().imag, "conj_t": z.conj().t(),
            "neg_0d": torch.tensor(1 - 3j).conj().imag, "conj_0d": torch.tensor(2 + 1j).conj(),
            "real": z.conj().real}
    out = start_copy(data, "cpu").get()
    for k, ref in data.items():
        o = out[k]
        assert o.dtype == ref.dtype and o.shape == ref.shape and o.device == ref.device, k
        assert torch.equal(o, ref.resolve_conj().resolve_neg()), f"{k} (seed 41)"


def test_dict_with_tuple_and_other_hashable_keys():
    a = np.arange(4)
    data = {(1, 2): a, ("x", (3, 4)): [a[::-1]], frozenset({1}): "v", 5: None, None: a,
            2.5: torch.ones(1), b"k": a}
    out = start_copy(data, "cpu").get()
    assert list(out) == list(data)
    assert torch.equal(out[(1, 2)], torch.from_numpy(a))
    assert torch.equal(out[("x", (3, 4))][0], torch.from_numpy(a[::-1].copy()))
    assert out[frozenset({1})] == "v" and out[5] is None
    assert torch.equal(out[None], torch.from_numpy(a))
    assert out[2.5] is data[2.5]
    assert torch.equal(out[b"k"], torch.from_numpy(a))


def test_many_errors_in_a_row_leave_no_leaks_or_stuck_jobs():
    before = mtc_loader.stats()
    for i in range(200):
        data = [np.ones(100)[::-1] for _ in range(3)] + [{"bad": np.zeros(1, dtype=np.longdouble)}]
        with pytest.raises(TypeError, match=r"data\[3\]\['bad'\]"):
            start_copy(data, "cpu", use_background_thread=bool(i % 2))
    after = mtc_loader.stats()
    # traversal errors are raised before any job starts
    assert after["jobs_submitted"] == before["jobs_submitted"]
    assert after["jobs_failed"] == before["jobs_failed"]
