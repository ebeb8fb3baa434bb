"""Where a manifest's frame files are, and reading them: a media root or a zip/tar bundle.

The rules (paths confined to the media root, bundle members) are described in
:mod:`vllm_video_plugin.manifest`.
"""

from __future__ import annotations

import io
import posixpath
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Final, Literal

import numpy as np
from numpy.typing import NDArray
from PIL import Image, UnidentifiedImageError

from vllm_video_plugin.decode import DecodeLimits
from vllm_video_plugin.manifest.schema import ManifestError

__all__ = [
    "BUNDLE_MANIFEST_NAME",
    "MEDIA_ROOT_ENV",
    "FrameReader",
    "MediaKind",
    "decode_image",
    "directory_reader",
    "sniff_media",
    "tar_reader",
    "zip_reader",
]

BUNDLE_MANIFEST_NAME: Final = "manifest.json"
"""Name of the manifest inside a zip or tar bundle."""
MEDIA_ROOT_ENV: Final = "VIDEO_GRPO_MEDIA_ROOT"
"""Environment variable naming the directory that manifest frame paths are confined to."""
_IMAGE_FORMATS: Final = ("PNG", "JPEG", "WEBP", "BMP")
_TAR_MAGIC_OFFSET: Final = 257

MediaKind = Literal["manifest", "zip", "tar", "video"]
"""What a media payload is: a JSON manifest, a zip or tar bundle, or anything else (a video)."""

FrameReader = Callable[[str, int], bytes]
"""Reads a frame file by its manifest path, refusing more than the given number of bytes."""


def sniff_media(data: bytes | bytearray | memoryview) -> MediaKind:
    """Tell a manifest, a zip bundle, a tar bundle and anything else (a video) apart by content."""
    head = bytes(data[:512])
    if head.lstrip()[:1] == b"{":
        return "manifest"
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        return "zip"
    if head[_TAR_MAGIC_OFFSET : _TAR_MAGIC_OFFSET + 5] == b"ustar":
        return "tar"
    return "video"


def decode_image(raw: bytes, where: str, limits: DecodeLimits) -> NDArray[np.uint8]:
    try:
        with Image.open(io.BytesIO(raw), formats=_IMAGE_FORMATS) as image:
            width, height = image.size
            if width * height > limits.max_frame_pixels:
                raise ManifestError(
                    where,
                    f"is {width}x{height} ({width * height} pixels), over the limit of "
                    f"{limits.max_frame_pixels} pixels",
                )
            return np.asarray(image.convert("RGB"), dtype=np.uint8)
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as error:
        raise ManifestError(where, f"not a readable {'/'.join(_IMAGE_FORMATS)} image ({error})") from error


def _check_relative(path: str, where: str) -> PurePosixPath:
    """``path`` as a relative POSIX path without ``..``, or a :class:`ManifestError`."""
    pure = PurePosixPath(path)
    if "\\" in path or "\0" in path:
        raise ManifestError(where, "backslashes and NUL characters are not allowed in frame paths")
    if ".." in pure.parts:
        raise ManifestError(where, "'..' is not allowed in frame paths")
    return pure


def directory_reader(media_root: Path, label: str) -> FrameReader:
    try:
        root = media_root.resolve(strict=True)
    except OSError as error:
        raise ManifestError(label, f"the media root {media_root} does not exist ({error})") from error
    if not root.is_dir():
        raise ManifestError(label, f"the media root {media_root} is not a directory")

    def read(path: str, max_bytes: int) -> bytes:
        where = f"{label} frame {path}"
        candidate = Path(_check_relative(path, where))
        if not candidate.is_absolute():
            candidate = root / candidate
        try:
            resolved = candidate.resolve(strict=True)
        except OSError as error:
            raise ManifestError(where, f"no such file under the media root {root} ({error})") from error
        if not resolved.is_relative_to(root):
            raise ManifestError(where, f"resolves to {resolved}, outside the media root {root}")
        if not resolved.is_file():
            raise ManifestError(where, f"{resolved} is not a regular file")
        size = resolved.stat().st_size
        if size > max_bytes:
            raise ManifestError(where, f"is {size} bytes, over the {max_bytes} bytes left of the read limit")
        return resolved.read_bytes()

    return read


def _bundle_name(path: str, where: str) -> str:
    pure = _check_relative(path, where)
    if pure.is_absolute():
        raise ManifestError(where, "paths inside a bundle must be relative")
    return posixpath.normpath(str(pure))


def zip_reader(bundle: zipfile.ZipFile, label: str) -> FrameReader:
    members = {posixpath.normpath(info.filename): info for info in bundle.infolist() if not info.is_dir()}

    def read(path: str, max_bytes: int) -> bytes:
        where = f"{label} member {path}"
        info = members.get(_bundle_name(path, where))
        if info is None:
            raise ManifestError(where, "is not in the zip bundle")
        if info.file_size > max_bytes:
            raise ManifestError(
                where, f"is {info.file_size} bytes, over the {max_bytes} bytes left of the read limit"
            )
        with bundle.open(info) as member:
            raw = member.read(max_bytes + 1)
        if len(raw) > max_bytes:  # the header under-reported the size
            raise ManifestError(where, f"holds more than the {max_bytes} bytes left of the read limit")
        return raw

    return read


def tar_reader(bundle: tarfile.TarFile, label: str) -> FrameReader:
    members = {posixpath.normpath(info.name): info for info in bundle.getmembers()}

    def read(path: str, max_bytes: int) -> bytes:
        where = f"{label} member {path}"
        info = members.get(_bundle_name(path, where))
        if info is None:
            raise ManifestError(where, "is not in the tar bundle")
        if not info.isfile():
            raise ManifestError(where, "is not a regular file (links are not followed in bundles)")
        if info.size > max_bytes:
            raise ManifestError(
                where, f"is {info.size} bytes, over the {max_bytes} bytes left of the read limit"
            )
        member = bundle.extractfile(info)
        assert member is not None  # regular files always extract
        with member:
            return member.read()

    return read
