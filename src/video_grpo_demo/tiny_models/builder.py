"""Content-addressed, atomic building of tiny model directories.

A tiny model directory is a pure function of its spec, its seed and the builder: the directory
name carries a hash of all three (plus the versions of the libraries that shape the files), a
finished build is moved into place with one ``rename``, and a directory that exists is complete.
A second call with the same inputs therefore returns at once, and two processes building the
same model at the same time both end up with the same, intact directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from rl_bridge.paths import cache_dir

__all__ = ["MANIFEST_NAME", "TinyModelSpec", "build_from_spec", "cache_key"]

#: File written last into every built directory: family, seed, spec, key and library versions.
MANIFEST_NAME = "tiny_model.json"

# Libraries whose version changes the written files (config defaults, tokenizer format, RNG).
_SHAPING_DISTRIBUTIONS = ("torch", "transformers", "tokenizers", "safetensors")


class TinyModelSpec(BaseModel, ABC):
    """The knobs of one tiny model family. Immutable; unknown fields are rejected.

    Subclasses set :attr:`family` and :attr:`builder_version` and implement :meth:`write`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: Family name accepted by :func:`video_grpo_demo.tiny_models.build_tiny_model`.
    family: ClassVar[str]

    #: Bump whenever :meth:`write` produces different files for the same spec, so that cached
    #: directories written by the old code stop matching instead of being reused.
    builder_version: ClassVar[int]

    @abstractmethod
    def write(self, out_dir: Path, *, seed: int) -> None:
        """Write config, weights, tokenizer and processor files into the empty ``out_dir``.

        Must be deterministic: the same spec and seed give byte-identical files.
        """


def _library_versions() -> dict[str, str]:
    return {name: metadata.version(name) for name in _SHAPING_DISTRIBUTIONS}


def _identity(spec: TinyModelSpec, seed: int) -> dict[str, Any]:
    return {
        "family": spec.family,
        "builder_version": spec.builder_version,
        "seed": seed,
        "spec": spec.model_dump(mode="json"),
        "libraries": _library_versions(),
    }


def cache_key(spec: TinyModelSpec, *, seed: int) -> str:
    """Hex SHA-256 of the family, spec, seed, builder version and shaping library versions."""
    blob = json.dumps(_identity(spec, seed), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def build_from_spec(
    spec: TinyModelSpec, *, seed: int = 0, out_dir: str | os.PathLike[str] | None = None
) -> Path:
    """Build the model described by ``spec`` unless it already exists; return its directory.

    Args:
        spec: The family's knobs.
        seed: Seed of the random weight initialisation.
        out_dir: Parent directory of the model directory; ``None`` means the project cache,
            ``cache_dir("tiny-models")``.

    Returns:
        ``<out_dir>/<family>-<first 12 hex digits of cache_key>``, complete.
    """
    root = cache_dir("tiny-models") if out_dir is None else Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    key = cache_key(spec, seed=seed)
    final = root / f"{spec.family}-{key[:12]}"
    if (final / MANIFEST_NAME).is_file():
        return final

    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        spec.write(staging, seed=seed)
        manifest = {**_identity(spec, seed), "cache_key": key}
        (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        staging.chmod(0o755)
        try:
            staging.rename(final)
        except OSError:
            # Another process finished the same build first; its directory is identical.
            if not (final / MANIFEST_NAME).is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return final
