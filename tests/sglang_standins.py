"""Stand-ins for the modules of SGLang's import path that cannot load on this CPU machine.

PyPI's torchvision links a CUDA torch (and is uninstalled for vLLM's sake), but SGLang's model
configs import ``torchvision.transforms`` when they are imported. A stand-in module answers
there: every attribute of it is an object that raises when called (nothing on SGLang's storage
path calls one). transformers is asked first whether torchvision is here (it caches the
answer: no), so that it never takes the stand-in for the real one. triton (vLLM's) imports as it
is; sgl_kernel is imported only where CUDA is visible.

`stand_ins` (tests/sglang_env.py) holds them for a block; ``tests/standins/sitecustomize.py``
for a whole process (the docs' commands, run by tests/test_sglang_docs.py).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Iterator
from typing import Any

STAND_INS = ("torchvision",)


class _Unusable:
    """A stand-in module's attribute: any attribute of it is another; calling it raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, name: str) -> _Unusable:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Unusable(f"{self._name}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name} is a test stand-in (tests/sglang_env.py)")


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> _Unusable:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Unusable(f"{self.__name__}.{name}")


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.split(".")[0] in STAND_INS:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install() -> _StandIns:
    """Put the stand-ins in reach of `import` (transformers asked first)."""
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()  # cached: transformers never sees the stand-in
    finder = _StandIns()
    sys.meta_path.insert(0, finder)
    return finder


@contextlib.contextmanager
def stand_ins() -> Iterator[None]:
    """The stand-ins importable inside the block (and forgotten after it)."""
    finder = install()
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in [m for m in sys.modules if m.split(".")[0] in STAND_INS]:
            del sys.modules[name]
