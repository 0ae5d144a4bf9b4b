"""Public names show their real signature (to help(), inspect.signature and so IDEs)."""
from __future__ import annotations

import inspect
import pydoc

import mtc_loader
from mtc_loader._wrap import PrefetchingDataLoader
from mtc_loader.prefetch import _ResumablePrefetchLoader


def _public_params(sig: inspect.Signature) -> list[str]:
    return [p.name for p in sig.parameters.values() if not p.name.startswith("_")]


def test_public_classes_show_their_constructors_parameters():
    """A class's signature is its __init__'s: a __new__ that dispatches (to the class that has
    state_dict over a stateful iterable) would show (*args, **kwargs) instead."""
    for name in mtc_loader.__all__:
        cls = getattr(mtc_loader, name)
        if not isinstance(cls, type):
            continue
        shown = inspect.signature(cls)
        init = list(inspect.signature(cls.__init__).parameters.values())[1:]
        assert list(shown.parameters.values()) == init, (name, shown)
    for cls in (_ResumablePrefetchLoader, PrefetchingDataLoader):
        assert _public_params(inspect.signature(cls)) == _public_params(inspect.signature(mtc_loader.PrefetchLoader))
    assert _public_params(inspect.signature(mtc_loader.PrefetchLoader)) == [
        "iterable", "device", "depth", "gil_switch_interval", "produce_on_caller", "start_copy_options"]
    assert "PrefetchLoader(iterable: " in pydoc.render_doc(mtc_loader.PrefetchLoader, renderer=pydoc.plaintext)


def test_the_stateful_dispatch_still_happens():
    class Stateful:
        def __iter__(self):
            return iter([])

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    loader = mtc_loader.PrefetchLoader(Stateful(), "cpu")
    assert isinstance(loader, _ResumablePrefetchLoader) and hasattr(loader, "state_dict")
    plain = mtc_loader.PrefetchLoader([], "cpu")
    assert type(plain) is mtc_loader.PrefetchLoader and not hasattr(plain, "state_dict")
    wrapped = PrefetchingDataLoader(Stateful(), "cpu")
    assert isinstance(wrapped, PrefetchingDataLoader) and isinstance(wrapped, _ResumablePrefetchLoader)
