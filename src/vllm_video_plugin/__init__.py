"""vLLM side of video GRPO: video loaders, cached-frame manifests, a model loader and refit support.

vLLM imports this package in every one of its processes (API server, engine core, workers)
through the ``vllm.general_plugins`` entry point and calls :func:`register`. Everything here
that is not :func:`register` (sampling, manifests) must import without vLLM installed.
"""

from __future__ import annotations

__all__ = ["PLUGIN_NAME", "register", "registered"]

#: Name of the entry point in the ``vllm.general_plugins`` group (usable in ``VLLM_PLUGINS``).
PLUGIN_NAME = "video_grpo"

_registered = False


def register() -> None:
    """Register this package's components with vLLM. Idempotent and cheap: no I/O, no config reads.

    vLLM may call it several times per process and once in each process it starts.
    """
    global _registered
    if _registered:
        return
    # Later components (video loaders, model loader) register here with guarded vLLM imports.
    _registered = True


def registered() -> bool:
    """Whether :func:`register` has run in this process (used by tests and health checks)."""
    return _registered
