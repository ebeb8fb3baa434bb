"""Cached-frame manifests: videos whose frames are already image files, with their real timing.

A manifest is a JSON document listing frame files and where each frame sits in its source video.
The sampling contract is applied over the **source** video's index space (its frame count, rate
and duration, as the manifest states them), and each sampled index is served by the cached frame
nearest to it; a manifest that caches every frame the contract samples therefore yields exactly
the frames, indices and timestamps that decoding the source video would.

Schema (version 1; unknown keys are rejected)::

    {
      "format": "video_grpo.frames/v1",   # required marker
      "source_fps": 30.0,       # frame rate of the source video, frames/s (optional, see below)
      "total_frames": 900,      # frames in the source video (optional: last frame index + 1)
      "duration_s": 30.0,       # source duration, seconds (optional: total_frames / source_fps)
      "frames": [               # at least one; any order; one shape for all
        {"path": "clip/000000.png", "index": 0},          # source frame index...
        {"path": "clip/000015.png", "timestamp_s": 0.5}   # ...or presentation time, seconds
      ]
    }

A frame gives ``index`` (its source frame index) or ``timestamp_s`` (its presentation time; the
index is ``round(timestamp_s * source_fps)``).

With ``source_fps`` the cached frames must cover the source the manifest claims: the cache may be
sparse (every 15th frame, say), but no more than its own spacing (the widest gap between two
consecutive cached frames; 1 for a single frame) may lie before its first frame or after its last
one, up to ``total_frames``. A manifest whose frame count disagrees with its entries (one cached
frame claiming ``total_frames=100000``, or the first 20 frames of a 100-frame source) is refused:
every index the contract samples past the cached frames would be served by the same cached frame,
one frame repeated in place of frames the manifest does not hold.

Without ``source_fps`` every frame must give ``timestamp_s``, and the listed frames are taken to be
the whole video (a variable-rate video, or frames extracted at irregular times): the contract
samples them by position, like a decoder samples a video's frames, at their mean rate
(``len(frames) / duration_s``). Their indices are then reported on a millisecond grid
(``fps`` 1000, index ``round(timestamp_s * 1000)``), which carries the irregular timing exactly
into Nemotron's and Qwen3-VL's prompt timestamps.

Where the frame files are. vLLM hands a video loader the bytes of the media only, never its URL, so
paths cannot be relative to the manifest's own location:

- a plain JSON manifest names files relative to a **media root** (or absolute paths inside it),
  configured by the server (the loader's ``media_root`` option or :data:`MEDIA_ROOT_ENV`). Every
  path must resolve, symlinks followed, to a file inside the root; ``..`` components are refused;
- a **bundle** is one self-contained file: a zip or an uncompressed tar holding ``manifest.json``
  and the frame files it names (paths relative to the bundle; regular members only). It needs no
  media root, and works over ``file://``, ``data:`` and ``http(s)://`` URLs alike.

Frame files are PNG, JPEG, WebP or BMP images, decoded with Pillow (as vLLM decodes images) to
RGB. Only the frames the contract picks are read. This package does not import vLLM.

The package: :mod:`.schema` validates the document, :mod:`.files` finds and reads frame files (media
root or bundle), :mod:`.load` samples a manifest with a contract.
"""

from vllm_video_plugin.manifest.files import BUNDLE_MANIFEST_NAME, MEDIA_ROOT_ENV, MediaKind, sniff_media
from vllm_video_plugin.manifest.load import ManifestFrames, load_manifest_frames
from vllm_video_plugin.manifest.schema import (
    MANIFEST_FORMAT,
    MILLISECOND_GRID_FPS,
    FrameManifest,
    ManifestError,
    ManifestFrame,
    parse_manifest,
)

__all__ = [
    "BUNDLE_MANIFEST_NAME",
    "MANIFEST_FORMAT",
    "MEDIA_ROOT_ENV",
    "MILLISECOND_GRID_FPS",
    "FrameManifest",
    "ManifestError",
    "ManifestFrame",
    "ManifestFrames",
    "MediaKind",
    "load_manifest_frames",
    "parse_manifest",
    "sniff_media",
]
