"""The bad-input corpus through the in-process layers, and the resource bounds through each route.

Layers (see :data:`video_grpo_demo.bad_inputs.LAYERS`): this package's vLLM loader
(``decoder``), the Gym request preparation (``gym_request``), the dataset validator (``dataset``)
and the trainer's preprocessing (``trainer``). Each observation is recorded in the reliability
report before it is asserted; the servers are in ``tests/integration/test_reliability_servers.py``.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from gym_video_env.datasets import main as datasets_main
from gym_video_env.datasets import validate_row
from gym_video_env.hookspecs import MediaSettings
from gym_video_env.request_media import MediaRequestError, prepare_request_media
from rl_bridge.paths import project_root
from rl_bridge.policy_inputs import PolicyInputBuilder, RolloutInputs
from rl_bridge.processors import load_processor
from rl_bridge.processors.qwen import QwenVLProcessor
from tests.fixtures.bad_inputs import FAULTS, Corpus, ReliabilityReport, case_ids, corpus_layers
from video_grpo_demo.bad_inputs import CORPUS_MAX_VIDEO_BYTES, LAYERS, BadInput
from vllm_video_plugin.cache import DecodeCache
from vllm_video_plugin.contract import VideoSamplingContract
from vllm_video_plugin.decode import DecodeLimits
from vllm_video_plugin.errors import VideoGRPOError
from vllm_video_plugin.loaders import VideoGRPOLoader

pytestmark = pytest.mark.unit

CONTRACT = VideoSamplingContract(style="uniform", num_frames=4)
#: The corpus's byte limit, as a media-io ``decode_limits`` block.
LIMITS_BLOCK = {"max_input_bytes": CORPUS_MAX_VIDEO_BYTES}


def _loader_kwargs(**decode_limits: Any) -> dict[str, Any]:
    block = CONTRACT.to_media_io_kwargs()
    del block["video_backend"]  # vLLM pops it before calling the loader
    return {**block, "decode_limits": {**LIMITS_BLOCK, **decode_limits}}


def _check(report: ReliabilityReport, case: BadInput, layer: str, observed: str, detail: str) -> None:
    report.record(case, layer, observed, detail)  # type: ignore[arg-type]
    assert observed == case.expected[layer], (
        f"{case.id} at {layer}: expected {case.expected[layer]}, got {detail}"
    )


def _names_input(detail: str, case: BadInput, *names: str) -> None:
    """The message names the input: one of ``names`` (file name, location, label) appears in it."""
    assert any(name in detail for name in names), f"{case.id}: the error names none of {names}: {detail}"


# -- decoder: this package's vLLM loader in process --------------------------------------------------------


@pytest.mark.parametrize("case_id", case_ids("decoder"))
def test_decoder(case_id: str, bad_input_corpus: Corpus, reliability_report: ReliabilityReport) -> None:
    case = bad_input_corpus.cases[case_id]
    payload = case.payload
    assert payload is not None
    started = time.monotonic()
    try:
        frames, metadata = VideoGRPOLoader.load_bytes(
            payload, media_root=str(bad_input_corpus.media_root), **_loader_kwargs()
        )
    except ValueError as error:
        detail = f"{type(error).__name__}: {error}"
        _check(reliability_report, case, "decoder", "error", detail)
        assert isinstance(error, VideoGRPOError), f"{case.id}: not one of this package's errors: {detail}"
        _names_input(detail, case, "<bytes sha256:")
    else:
        height, width = frames.shape[1:3]
        detail = f"decoded {len(frames)} frames of {width}x{height} (indices {metadata['frames_indices']})"
        _check(reliability_report, case, "decoder", "accepted", detail)
    assert time.monotonic() - started < 10, f"{case.id}: the loader took {time.monotonic() - started:.1f} s"


def test_decoder_refuses_the_pixel_budget_from_the_header(bad_input_corpus: Corpus) -> None:
    """The over-budget stream holds 4 KiB of data for 10000x10000 frames: only the header was read."""
    case = bad_input_corpus.cases["over_pixel_budget"]
    with pytest.raises(VideoGRPOError, match=r"frames are 10000x10000 \(100000000 pixels\), over the limit"):
        VideoGRPOLoader.load_bytes(case.payload, **_loader_kwargs())


def test_decoder_decodes_the_unusual_but_valid_videos(bad_input_corpus: Corpus) -> None:
    rotated, _ = VideoGRPOLoader.load_bytes(bad_input_corpus.cases["rotation_90"].payload, **_loader_kwargs())
    assert rotated.shape[1:3] == (64, 48)  # stored 64 wide, 48 high; shown rotated
    odd, _ = VideoGRPOLoader.load_bytes(bad_input_corpus.cases["odd_size"].payload, **_loader_kwargs())
    assert odd.shape[1:3] == (47, 63)
    _, metadata = VideoGRPOLoader.load_bytes(
        bad_input_corpus.cases["overreported_frame_count"].payload, **_loader_kwargs()
    )
    assert metadata["total_num_frames"] == 8  # the header's 1000 is not believed


# -- gym_request: media preparation of the Gym model server ---------------------------------------------


def _gym_settings(corpus: Corpus) -> MediaSettings:
    return MediaSettings(media_root=corpus.media_root, max_video_bytes=CORPUS_MAX_VIDEO_BYTES)


@pytest.mark.parametrize("case_id", case_ids("gym_request"))
def test_gym_request(case_id: str, bad_input_corpus: Corpus, reliability_report: ReliabilityReport) -> None:
    case = bad_input_corpus.cases[case_id]
    try:
        prepared = prepare_request_media({"input": case.items}, _gym_settings(bad_input_corpus))
    except MediaRequestError as error:
        detail = f"{type(error).__name__}: {error}"
        _check(reliability_report, case, "gym_request", "error", detail)
        assert re.match(r"input\[\d+\]", error.location), detail
    else:
        items = prepared["input"]
        media = [
            part.get("video_url", {}).get("url", "")
            for item in items
            if isinstance(item, dict) and isinstance(item.get("content"), list)
            for part in item["content"]
            if isinstance(part, dict) and part.get("type") == "input_video"
        ]
        detail = f"passed on: {len(items)} items, videos {media}"
        _check(reliability_report, case, "gym_request", "accepted", detail)


def test_gym_request_relocates_tool_output_media(bad_input_corpus: Corpus) -> None:
    items = prepare_request_media(
        {"input": bad_input_corpus.cases["tool_output_media"].items}, _gym_settings(bad_input_corpus)
    )["input"]
    assert [item.get("type") for item in items] == [None, "function_call", "function_call_output", "message"]
    assert items[-1]["role"] == "user" and items[-1]["content"][0]["type"] == "input_video"


# -- dataset: the validator ---------------------------------------------------------------------------


@pytest.mark.parametrize("case_id", case_ids("dataset"))
def test_dataset(case_id: str, bad_input_corpus: Corpus, reliability_report: ReliabilityReport) -> None:
    case = bad_input_corpus.cases[case_id]
    problems = validate_row(case.row(), _gym_settings(bad_input_corpus))
    if problems:
        detail = "; ".join(problems)
        _check(reliability_report, case, "dataset", "error", detail)
        assert all(re.match(r"input\[\d+\]\.(content|output)\[\d+\]: ", problem) for problem in problems), (
            detail
        )
    else:
        _check(reliability_report, case, "dataset", "accepted", "valid")


# -- trainer: policy inputs from a rollout ----------------------------------------------------------------


@pytest.fixture(scope="module")
def processor(tiny_qwen25vl: Path) -> QwenVLProcessor:
    loaded = load_processor(tiny_qwen25vl)
    assert isinstance(loaded, QwenVLProcessor)
    return loaded


@pytest.fixture(scope="module")
def builder(processor: QwenVLProcessor, bad_input_corpus: Corpus) -> PolicyInputBuilder:
    """One builder for every trainer case, as a training run has: the cases are its batch."""
    return PolicyInputBuilder(
        processor,
        MediaSettings(media_root=bad_input_corpus.media_root),
        decode_cache=DecodeCache(),
        limits=DecodeLimits(max_input_bytes=CORPUS_MAX_VIDEO_BYTES),
    )


def _rollout(builder: PolicyInputBuilder, items: list[dict[str, Any]]) -> dict[str, Any]:
    """A one-turn rollout of ``items`` whose prompt tokens hold the placeholders its media expand to
    (none for media that cannot be processed: the builder masks those before comparing)."""
    from rl_bridge.trajectory import TrajectoryError, prompt_media

    prompt_ids = [11, 12]
    try:
        parts = prompt_media(items)
    except TrajectoryError:
        parts = ()
    for part in parts:
        try:
            processed = builder.store.get(part)
        except ValueError:
            continue
        for length in processed.placeholder_runs:
            prompt_ids += [20, *[processed.placeholder_token_id] * length, 21]
    call = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "A"}],
        "prompt_token_ids": [*prompt_ids, 13],
        "generation_token_ids": [30, 31],
        "generation_log_probs": [-0.5, -0.25],
    }
    return {"responses_create_params": {"input": items}, "response": {"output": [call]}}


def _trainer_detail(inputs: RolloutInputs) -> str:
    if inputs.masked:
        return f"masked: {inputs.mask_reason}: {inputs.mask_detail}"
    shapes = [tuple(item.num_placeholders for item in sequence.media) for sequence in inputs.sequences]
    return f"trained: {len(inputs.sequences)} sequence(s), media placeholders {shapes}"


@pytest.mark.parametrize("case_id", case_ids("trainer"))
def test_trainer(
    case_id: str, bad_input_corpus: Corpus, builder: PolicyInputBuilder, reliability_report: ReliabilityReport
) -> None:
    case = bad_input_corpus.cases[case_id]
    before = dict(builder.metrics.masked)
    samples = builder.metrics.samples
    inputs = builder.build(_rollout(builder, case.items))  # never raises
    detail = _trainer_detail(inputs)
    _check(reliability_report, case, "trainer", "error" if inputs.masked else "accepted", detail)
    assert builder.metrics.samples == samples + 1
    if inputs.masked:
        assert inputs.loss_weight == 0.0 and not inputs.sequences and inputs.mask_detail
        assert builder.metrics.masked[inputs.mask_reason] == before.get(inputs.mask_reason, 0) + 1
        assert inputs.to_policy_samples(advantage=1.0) == []
        root = bad_input_corpus.media_root
        if case.path is not None and case.path.is_relative_to(root):
            # The file, by its path relative to the media root (its content hash beside it).
            _names_input(inputs.mask_detail, case, case.path.relative_to(root).as_posix())


def test_a_text_only_row_trains_next_to_video_rows(
    bad_input_corpus: Corpus, builder: PolicyInputBuilder
) -> None:
    from rl_bridge.megatron.batch import MediaTokens, collate

    video = bad_input_corpus.good_video.relative_to(bad_input_corpus.media_root).as_posix()
    video_items = [
        {
            "role": "user",
            "content": [
                {"type": "input_video", "video_url": video},
                {"type": "input_text", "text": "colour?"},
            ],
        }
    ]
    batch = [
        builder.build(_rollout(builder, items))
        for items in (video_items, bad_input_corpus.cases["text_only_row"].items, video_items)
    ]
    assert [inputs.masked for inputs in batch] == [False, False, False]
    samples = [sample for inputs in batch for sample in inputs.to_policy_samples(advantage=0.5)]
    assert [len(sample.media) for sample in samples] == [1, 0, 1]
    processor = builder.processor
    assert isinstance(processor, QwenVLProcessor)
    tokens = MediaTokens(
        video_token_id=processor.video_token_id, image_token_id=processor.image_token_id, spatial_merge_size=2
    )
    collated = collate(samples, pad_token_id=0, media_tokens=tokens)
    assert (
        collated.media["video_grid_thw"].shape[0]
        == 2 * samples[0].media[0].tensors["video_grid_thw"].shape[0]
    )


# -- resource bounds through each route --------------------------------------------------------------------


def test_limits_through_vllm_media_io_kwargs(bad_input_corpus: Corpus) -> None:
    """The loader's ``decode_limits`` as vLLM passes ``--media-io-kwargs '{"video": {...}}'`` on:
    through vLLM's own ``MediaConnector`` (the server's path from URL to loader), in process."""
    from vllm.multimodal.media.connector import MediaConnector

    import vllm_video_plugin
    from vllm_video_plugin import compat

    vllm_video_plugin.register()
    url = bad_input_corpus.good_video.as_uri()
    size = bad_input_corpus.good_video.stat().st_size

    def fetch(num_frames: int = 4, **limits: Any) -> Any:
        contract = VideoSamplingContract(style="uniform", num_frames=num_frames)
        block = {**contract.to_media_io_kwargs(), "decode_limits": limits}
        connector = MediaConnector(
            {"video": block}, allowed_local_media_path=str(bad_input_corpus.media_root)
        )
        return connector.fetch_video(url)

    frames, _ = compat.fetched_video(fetch())  # a MediaWithBytes from vLLM 0.27, a tuple before
    assert frames.shape == (4, 64, 64, 3)
    with pytest.raises(ValueError, match=rf"is {size} bytes, over the limit of {size - 1} bytes"):
        fetch(max_input_bytes=size - 1)
    with pytest.raises(ValueError, match=r"64x64 \(4096 pixels\), over the limit of 4095 pixels"):
        fetch(max_frame_pixels=4095)
    with pytest.raises(ValueError, match="the video has 8 frames, over the limit of 7"):
        fetch(max_frames=7)
    with pytest.raises(ValueError, match="decoding took longer than the limit of 0 s"):
        fetch(num_frames=3, timeout_s=0)  # a contract not decoded yet: time is checked while decoding
    with pytest.raises(ValueError, match=r"unknown decode limits \['max_bytes'\]"):
        fetch(max_bytes=1)


def test_limits_through_gym_media_settings(bad_input_corpus: Corpus) -> None:
    part = {"type": "input_video", "video_url": bad_input_corpus.good_video.name}
    body = {"input": [{"role": "user", "content": [{**part, "video_url": "videos/good.mp4"}]}]}
    size = bad_input_corpus.good_video.stat().st_size
    prepare_request_media(body, MediaSettings(media_root=bad_input_corpus.media_root, max_video_bytes=size))
    with pytest.raises(
        MediaRequestError, match=f"videos/good.mp4: is {size} bytes, more than the limit of {size - 1}"
    ):
        prepare_request_media(
            body, MediaSettings(media_root=bad_input_corpus.media_root, max_video_bytes=size - 1)
        )


def test_limits_through_the_dataset_validator(
    bad_input_corpus: Corpus, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = tmp_path / "rows.jsonl"
    row = {
        "responses_create_params": {
            "input": [{"role": "user", "content": [{"type": "input_video", "video_url": "videos/good.mp4"}]}]
        },
        "answer": "A",
    }
    rows.write_text(json.dumps(row) + "\n")
    root = str(bad_input_corpus.media_root)
    assert datasets_main(["validate", str(rows), "--media-root", root]) == 0
    for flags, reason in [
        (["--max-frame-pixels", "4095"], "over the limit of 4095 pixels"),
        (["--max-frames", "7"], "the video has 8 frames, over the limit of 7"),
        (["--decode-timeout-s", "0"], "decoding took longer than the limit of 0"),
        (["--max-video-bytes", "100"], "more than the limit of 100 bytes"),
    ]:
        assert datasets_main(["validate", str(rows), "--media-root", root, *flags]) == 1, flags
        assert reason in capsys.readouterr().err, flags


def test_limits_through_the_trainer(bad_input_corpus: Corpus, processor: QwenVLProcessor) -> None:
    items = [{"role": "user", "content": [{"type": "input_video", "video_url": "videos/good.mp4"}]}]
    for limits, reason in [
        (DecodeLimits(max_frame_pixels=4095), "media_undecodable"),
        (DecodeLimits(max_frames=7), "media_undecodable"),
        (DecodeLimits(max_input_bytes=100), "media_unavailable"),
    ]:
        builder = PolicyInputBuilder(
            processor,
            MediaSettings(media_root=bad_input_corpus.media_root),
            decode_cache=DecodeCache(),
            limits=limits,
        )
        inputs = builder.build(_rollout(builder, items))
        assert inputs.mask_reason == reason, (limits, inputs.mask_detail)
        assert builder.metrics.as_dict()[f"media/masked/{reason}"] == 1


# -- the committed table -------------------------------------------------------------------------------------


def test_reliability_doc_has_a_row_for_every_case_and_layer() -> None:
    """docs/RELIABILITY.md (rendered by scripts/reliability_table) covers the corpus as defined now."""
    doc = project_root() / "docs" / "RELIABILITY.md"
    assert doc.is_file(), "docs/RELIABILITY.md is missing: run the tests, then scripts/reliability_table"
    text = doc.read_text()
    missing = [
        f"{case_id}/{layer}"
        for case_id, layers in corpus_layers().items()
        for layer in layers
        if not re.search(rf"^\| `{re.escape(case_id)}` \| {layer} \|", text, flags=re.MULTILINE)
    ]
    assert not missing, f"docs/RELIABILITY.md has no row for {missing}; regenerate it (see its last section)"
    assert set(LAYERS) >= {layer for layers in corpus_layers().values() for layer in layers}


def test_reliability_doc_has_a_row_for_every_fault() -> None:
    """docs/RELIABILITY.md has a row, with its layer, for every fault of the catalogue as defined now."""
    text = (project_root() / "docs" / "RELIABILITY.md").read_text()
    missing = [
        f"{fault.id}/{fault.layer}"
        for fault in FAULTS
        if not re.search(rf"^\| `{re.escape(fault.id)}` \| {fault.layer} \|", text, flags=re.MULTILINE)
    ]
    assert not missing, (
        f"docs/RELIABILITY.md has no row for faults {missing}; regenerate it (see its last section)"
    )


def test_fault_observations_name_a_catalogued_test_and_merge_per_fault_and_test(tmp_path: Path) -> None:
    fault = next(fault for fault in FAULTS if len(fault.tests) > 1)
    first, second = fault.tests[:2]
    with pytest.raises(ValueError, match="not in the catalogue"):
        ReliabilityReport().record_fault("no_such_fault", first, "observed")
    with pytest.raises(ValueError, match=f"records fault '{fault.id}', whose catalogue entry names only"):
        ReliabilityReport().record_fault(fault.id, "tests/unit/test_elsewhere.py::test_x", "observed")

    path = tmp_path / "report.json"
    earlier = ReliabilityReport()
    earlier.record_fault(fault.id, first, "by the first test")
    earlier.record_fault(fault.id, second, "by the second test, earlier")
    earlier.test_finished(first, passed=True)
    earlier.merge_into(path)
    later = ReliabilityReport(substitutions={str(tmp_path): "<tmp>"})
    later.record_fault(fault.id, second, f"by the second test in {tmp_path}")
    later.test_finished(second, passed=False)
    later.merge_into(path)

    report = json.loads(path.read_text())
    assert [entry["id"] for entry in report["faults"]] == [fault.id for fault in FAULTS]
    observations = {entry["test"]: entry for entry in report["fault_results"]}
    assert observations[first]["observed"] == "by the first test" and observations[first]["passed"] is True
    assert observations[second]["observed"] == "by the second test in <tmp>"
    assert observations[second]["passed"] is False
