"""Import Megatron-Bridge on hosts without Transformer Engine.

Transformer Engine (TE) is an optional extra of Megatron-Bridge (``megatron-bridge[te]``), and
megatron-core builds and runs models without it (the "local" layer spec). Yet in
megatron-bridge 0.6.2 ``megatron/bridge/peft/lora_layers.py`` does
``import transformer_engine.pytorch as te`` unconditionally at module level, and that module is
reached from ``megatron/bridge/__init__.py``, so ``import megatron.bridge`` (and with it
``AutoBridge``) fails with ``ModuleNotFoundError`` wherever TE is not installed: every CPU host, and
GPU images where TE's 276 MB wheel or its nvcc build is not available. Its only other uses of
``te`` are inside the fused-LoRA code path, behind ``isinstance(module, (te.Linear, ...))`` checks.

:func:`import_megatron_bridge` works around that without changing what anything else sees:

* when ``transformer_engine`` is importable it is a plain ``import megatron.bridge``;
* otherwise a stand-in ``transformer_engine`` / ``transformer_engine.pytorch`` pair is placed in
  ``sys.modules`` only while the body of ``megatron.bridge.peft.lora_layers`` executes, then
  removed. Every other module (megatron-core's and Megatron-Bridge's own ``HAVE_TE`` probes,
  ``megatron.core.utils.get_te_version``) still finds TE absent and takes its non-TE path.
  A stand-in visible for the whole ``import megatron.bridge`` would be found by about twenty such
  probes, which would then record TE as installed.

Attributes of the stand-in are placeholder classes: ``isinstance`` checks against them are
``False`` and instantiating one raises :class:`ImportError` that names the missing package.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

__all__ = ["import_megatron_bridge", "transformer_engine_installed", "transformer_engine_standin"]

_TE = "transformer_engine"
_TE_PYTORCH = "transformer_engine.pytorch"
# The one module that imports TE unconditionally (megatron-bridge 0.6.2).
_UNCONDITIONAL_TE_IMPORTER = "megatron.bridge.peft.lora_layers"


def transformer_engine_installed() -> bool:
    """Whether the real Transformer Engine package can be imported (checked without importing it)."""
    module = sys.modules.get(_TE)
    if module is not None:
        return not isinstance(module, _StandinModule)
    return importlib.util.find_spec(_TE) is not None


class _PlaceholderType(type):
    """Metaclass of the stand-in's attributes: attribute access yields further placeholders."""

    def __getattr__(cls, name: str) -> _PlaceholderType:
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}")


class _Placeholder(metaclass=_PlaceholderType):
    """Base of all stand-in attributes; never instantiable."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Placeholder:
        raise ImportError(
            f"{_TE}.pytorch.{cls.__qualname__} was used, but Transformer Engine is not installed "
            f"(install megatron-bridge[te] to use Transformer Engine layers)"
        )


_PLACEHOLDERS: dict[str, _PlaceholderType] = {}


def _placeholder(qualname: str) -> _PlaceholderType:
    """The placeholder class for ``qualname``; one class per name, so identity checks are stable."""
    if qualname not in _PLACEHOLDERS:
        cls = _PlaceholderType(qualname.rsplit(".", 1)[-1], (_Placeholder,), {"__module__": _TE_PYTORCH})
        cls.__qualname__ = qualname
        _PLACEHOLDERS[qualname] = cls
    return _PLACEHOLDERS[qualname]


class _StandinModule(types.ModuleType):
    """A stand-in module whose public attributes are placeholder classes."""

    def __getattr__(self, name: str) -> _PlaceholderType:
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(name)


def _make_standin() -> dict[str, types.ModuleType]:
    package = _StandinModule(_TE, "Stand-in for the absent Transformer Engine package.")
    package.__path__ = []  # a package, so that ``transformer_engine.pytorch`` resolves
    pytorch = _StandinModule(_TE_PYTORCH, "Stand-in for the absent transformer_engine.pytorch.")
    package.pytorch = pytorch
    return {_TE: package, _TE_PYTORCH: pytorch}


class _StandinDuringExec(importlib.abc.Loader):
    """Wraps a module's loader so that the TE stand-in exists only while that module executes."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        standin = _make_standin()
        sys.modules.update(standin)
        try:
            self._inner.exec_module(module)
        finally:
            for name, stand_module in standin.items():
                if sys.modules.get(name) is stand_module:
                    del sys.modules[name]


class _StandinFinder(importlib.abc.MetaPathFinder):
    """Finds :data:`_UNCONDITIONAL_TE_IMPORTER` normally and arms the stand-in for its execution."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _UNCONDITIONAL_TE_IMPORTER:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _StandinDuringExec(spec.loader)
        return spec


@contextmanager
def transformer_engine_standin() -> Iterator[bool]:
    """Let ``import megatron.bridge`` inside the block succeed without Transformer Engine.

    Yields:
        ``True`` when the stand-in is armed (TE is not installed), ``False`` when real TE is
        installed, in which case nothing is changed.

    On exit the import hook is removed; ``sys.modules`` never holds the stand-in outside the
    execution of ``megatron.bridge.peft.lora_layers``.
    """
    if transformer_engine_installed():
        yield False
        return
    finder = _StandinFinder()
    sys.meta_path.insert(0, finder)
    try:
        yield True
    finally:
        sys.meta_path.remove(finder)


def import_megatron_bridge() -> types.ModuleType:
    """Import and return ``megatron.bridge``, with the TE stand-in when TE is not installed."""
    with transformer_engine_standin():
        return importlib.import_module("megatron.bridge")
