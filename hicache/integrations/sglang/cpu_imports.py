"""SGLang's import path where torchvision does not load (a CPU torch). Imports no SGLang.

SGLang's memory pools import its model configs, and those import ``torchvision.transforms``
(for its multimodal models). PyPI's torchvision is built against PyPI's CUDA torch: beside a
CPU torch (vLLM's CPU build; the torch of hicache's CPU install) it is absent or fails to load.
Nothing on SGLang's storage path (its host pools, cache controller and storage backends)
calls torchvision, so `without_torchvision` puts a stand-in where it is missing: imports of it
work, and calling anything of it raises. It is for programs that drive SGLang's storage path
themselves on a CPU (examples/sglang_cpu.py, bench/sglang.py, the tests); where torchvision
loads, it does nothing. An SGLang server has its own torchvision and never needs it.
"""

from __future__ import annotations

import contextlib
import importlib
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
        raise RuntimeError(
            f"{self._name}: torchvision does not load here; hicache stood in for it so that "
            "SGLang's storage path imports (hicache.integrations.sglang.cpu_imports)"
        )


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


_installed: _StandIns | None = None


def torchvision_loads() -> bool:
    """Whether torchvision imports here (what it left half-imported is forgotten if not)."""
    try:
        importlib.import_module("torchvision")
        return True
    except Exception:  # absent (ImportError), or built for another torch (RuntimeError, OSError)
        _forget()
        return False


def without_torchvision() -> bool:
    """Stand in for torchvision where it does not load, for the rest of the process; whether
    it did (False: torchvision loads, nothing changed). Call before importing SGLang."""
    global _installed
    if _installed is not None:
        return True
    if torchvision_loads():
        return False
    _installed = _install()
    return True


@contextlib.contextmanager
def stand_ins() -> Iterator[None]:
    """The stand-in importable inside the block only, whether or not torchvision loads (the
    tests: what SGLang imports inside keeps it; nothing imported later sees it)."""
    finder = _install()
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        _forget()


def _install() -> _StandIns:
    """Put the stand-in first on the import path, transformers asked first whether torchvision
    is here (it caches the answer, so it never takes the stand-in for the real one)."""
    with contextlib.suppress(ImportError):
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()
    finder = _StandIns()
    sys.meta_path.insert(0, finder)
    return finder


def _forget() -> None:
    for name in [m for m in sys.modules if m.split(".")[0] in STAND_INS]:
        del sys.modules[name]
