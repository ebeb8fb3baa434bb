"""Start real NeMo Gym servers on loopback, each a process of the Gym environment's Python, without Ray.

A Gym server is its directory's ``app.py`` run with two environment variables, as ``gym env start``
runs it after setting up venvs: ``NEMO_GYM_CONFIG_DICT`` (the whole resolved global config, as YAML)
and ``NEMO_GYM_CONFIG_PATH`` (the server's instance name in it). Servers find each other by instance
name through that shared config (``ServerClient`` reads host and port from it), so servers that
reference each other are resolved together, as one :class:`GymServerSpec` set, into one config.

The config is resolved by Gym's own parser (the code behind ``gym env resolve``) in the Gym
environment, which fills in the keys a server expects (``dry_run``, ``head_server``, ...) and checks
fields and server references. That step runs this module there::

    <gym python> -m rl_bridge.services.gym_server resolve REQUEST.json RESULT.json

The head server is only needed by processes that are not Gym servers but use Gym's client (such as
``gym eval run --no-serve``): they fetch the config from it. :func:`start_gym_servers` starts it on
request (``head_server=True``) with ``<gym python> -m rl_bridge.services.gym_server head``.

This module imports nothing from NeMo Gym at module level, so the trainer's environment can use it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from rl_bridge.paths import gym_python, is_site_dir
from rl_bridge.services.process import ManagedProcess, ServiceError, free_port, wait_for_http

__all__ = [
    "LOOPBACK",
    "SERVER_TYPES",
    "GymConfig",
    "GymServerSpec",
    "video_model_server_spec",
    "GymServerType",
    "GymServers",
    "resolve_gym_config",
    "start_gym_servers",
]

LOOPBACK = "127.0.0.1"
HEAD_SERVER_NAME = "head_server"
# Set by Gym for its servers; a server reads its config from them instead of resolving one.
_INJECTED_CONFIG_VARS = ("NEMO_GYM_CONFIG_DICT", "NEMO_GYM_CONFIG_PATH")

GymServerType = Literal[
    "responses_api_models", "responses_api_agents", "resources_servers", "environment_servers"
]
SERVER_TYPES: tuple[str, ...] = get_args(GymServerType)
"""The directories under a Gym root that hold servers, one per :data:`GymServerType`."""


@dataclass(frozen=True)
class GymServerSpec:
    """One Gym server instance: which server directory runs, under which name, with which fields.

    Example: the stock example resources server of the installed nemo-gym::

        GymServerSpec("weather", "resources_servers", "example_single_tool_call", {"domain": "agent"})
    """

    name: str
    """Instance name (top-level key of the global config); other servers address it by this name."""
    server_type: GymServerType
    implementation: str
    """Directory name under ``<root>/<server_type>/``, e.g. ``vllm_model``. Roots: the extra roots
    given to :func:`resolve_gym_config`, then the installed nemo-gym (its built-in servers)."""
    fields: Mapping[str, Any] = field(default_factory=dict)
    """The server's config fields (JSON-serialisable; ``Path`` values become strings). ``host`` and
    ``port`` default to loopback and a free port."""
    entrypoint: str = "app.py"

    def __post_init__(self) -> None:
        if self.server_type not in SERVER_TYPES:
            raise ValueError(
                f"Invalid server_type ({self.server_type!r}) for Gym server {self.name!r}. "
                f"Supported values are {', '.join(SERVER_TYPES)}."
            )
        if not self.name or self.name == HEAD_SERVER_NAME:
            raise ValueError(
                f"Invalid Gym server name {self.name!r}: it must be non-empty and not {HEAD_SERVER_NAME!r}."
            )

    def ref(self) -> dict[str, str]:
        """The value another server's field takes to reference this server (e.g. ``resources_server``)."""
        return {"type": self.server_type, "name": self.name}


def video_model_server_spec(
    name: str, *, openai_url: str | Sequence[str], model: str, media_root: str | Path, **fields: Any
) -> GymServerSpec:
    """This package's ``video_vllm_model`` in front of a vLLM OpenAI endpoint (or several: Gym
    keeps each session on one of them, chosen by a hash of its id), set up for training.

    Token ids and logprobs come back (``return_token_id_information``), the reasoning parser is
    off, media resolve under ``media_root``, and a prompt over vLLM's context is answered with
    vLLM's 400 (``propagate_context_overflow_errors``; Gym's default is an empty assistant turn with
    no tokens), so ``video_tools_agent`` scores a later turn's overflow as a policy fault and a
    first turn's as a bad row. A vanished vLLM fails a request after 8 connection retries (about
    4 s; ``vllm_connection_retries``) instead of being retried until it answers: the caller's
    supervisor restarts it and re-dispatches, and an input that kills vLLM is not replayed into each
    restarted server. ``fields`` add or override config fields (see the server's
    ``configs/video_vllm_model.yaml``).
    """
    base = {
        "base_url": openai_url if isinstance(openai_url, str) else list(openai_url),
        "api_key": "unused",
        "model": model,
        "return_token_id_information": True,
        "request_prompt_and_generation_token_ids": True,
        "uses_reasoning_parser": False,
        "media_root": media_root,
        "propagate_context_overflow_errors": True,
        "vllm_connection_retries": 8,
    }
    return GymServerSpec(name, "responses_api_models", "video_vllm_model", {**base, **fields})


@dataclass(frozen=True)
class GymConfig:
    """A global config as Gym resolved it, and where each server's directory is."""

    yaml: str
    """The config exactly as servers receive it in ``NEMO_GYM_CONFIG_DICT``."""
    resolved: dict[str, Any]
    """The same config as plain data, interpolations resolved (for inspection)."""
    server_dirs: dict[str, Path]
    """Server instance name -> the directory its entrypoint runs in."""
    extra_roots: tuple[Path, ...] = ()

    def server_fields(self, name: str) -> dict[str, Any]:
        """The resolved fields of server ``name`` (its ``{type: {implementation: fields}}`` unwrapped)."""
        try:
            by_type = self.resolved[name]
        except KeyError:
            raise KeyError(
                f"No Gym server {name!r} in this config; servers: {sorted(self.server_dirs)}"
            ) from None
        (by_implementation,) = by_type.values()
        (fields,) = by_implementation.values()
        return fields

    def url(self, name: str) -> str:
        """Base URL of server ``name`` (or of the head server, ``"head_server"``)."""
        fields = self.resolved[HEAD_SERVER_NAME] if name == HEAD_SERVER_NAME else self.server_fields(name)
        return f"http://{fields['host']}:{fields['port']}"


def resolve_gym_config(
    specs: Sequence[GymServerSpec],
    *,
    run_dir: Path,
    global_fields: Mapping[str, Any] | None = None,
    extra_roots: Iterable[Path] = (),
    timeout_s: float = 120.0,
) -> GymConfig:
    """Resolve the global config of ``specs`` with Gym's own parser, in the Gym environment.

    Every server binds loopback on a free port unless its fields say otherwise; so does the head
    server. Gym's artifact and cache directories go under ``run_dir``.

    Args:
        specs: the servers; names must be unique.
        run_dir: directory for this set of servers (config request, results, caches, logs).
        global_fields: top-level config keys, e.g. ``policy_base_url`` for ``${policy_base_url}``.
        extra_roots: directories laid out like Gym's (``<root>/<server_type>/<implementation>``)
            searched before the installed nemo-gym, as with ``NEMO_GYM_EXTRA_ROOTS``; never a
            site-packages directory (Gym puts these roots on the front of ``sys.path``).
        timeout_s: limit for the resolution subprocess, in seconds.

    Raises:
        ValueError: repeated server names, or a search root that is a site-packages directory.
        ServiceError: Gym rejected the config (its message is included) or a server directory is
            missing.
    """
    names = [spec.name for spec in specs]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"Gym server names must be unique; repeated: {', '.join(duplicates)}")
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    roots = tuple(Path(root).resolve() for root in extra_roots)
    shadowing = [str(root) for root in roots if is_site_dir(root)]
    if shadowing:
        raise ValueError(
            f"Gym search roots must not be an environment's packages ({', '.join(shadowing)}): NeMo Gym "
            "puts its extra roots at the front of sys.path, where they would shadow the Gym environment's "
            "own packages. Pass the directory holding the server directories, or none for a package "
            "installed in the Gym environment (see rl_bridge.paths.gym_search_roots)."
        )

    initial: dict[str, Any] = {
        "default_host": LOOPBACK,
        HEAD_SERVER_NAME: {"host": LOOPBACK, "port": free_port(LOOPBACK)},
        "results_dir": str(run_dir / "results"),
        "cache_dir": str(run_dir / "cache"),
        **(global_fields or {}),
    }
    for spec in specs:
        fields = {"entrypoint": spec.entrypoint, "host": LOOPBACK, **spec.fields}
        fields.setdefault("port", free_port(LOOPBACK))
        initial[spec.name] = {spec.server_type: {spec.implementation: fields}}

    request_path = run_dir / "gym_config_request.json"
    result_path = run_dir / "gym_config.json"
    request_path.write_text(json.dumps({"config": initial}, indent=2, default=_json_default))
    result_path.unlink(missing_ok=True)
    try:
        completed = subprocess.run(
            [str(gym_python()), "-m", __name__, "resolve", str(request_path), str(result_path)],
            cwd=run_dir,
            env=_resolver_env(roots),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise ServiceError(
            f"NeMo Gym did not resolve the config in {request_path} within {timeout_s:.0f} s"
        ) from exc
    if completed.returncode != 0 or not result_path.is_file():
        raise ServiceError(
            f"NeMo Gym could not resolve the config in {request_path} (exit code {completed.returncode}):\n"
            f"{_tail(completed.stderr + completed.stdout)}"
        )
    result = json.loads(result_path.read_text())
    return GymConfig(
        yaml=result["yaml"],
        resolved=result["resolved"],
        server_dirs={name: Path(path) for name, path in result["server_dirs"].items()},
        extra_roots=roots,
    )


class GymServers:
    """Running Gym servers of one config, stopped together (context manager or :meth:`stop`)."""

    def __init__(self, config: GymConfig, processes: Mapping[str, ManagedProcess]) -> None:
        self.config = config
        self.processes = dict(processes)

    def url(self, name: str) -> str:
        """Base URL of server ``name`` (``"head_server"`` for the head server, when started)."""
        if name not in self.processes:
            raise KeyError(f"No running Gym server {name!r}; running: {sorted(self.processes)}")
        return self.config.url(name)

    def stop(self) -> None:
        """Stop every server (safe to call more than once)."""
        for process in self.processes.values():
            process.stop()

    def __enter__(self) -> GymServers:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"GymServers({ {name: self.config.url(name) for name in self.processes} })"


def start_gym_servers(
    specs: Sequence[GymServerSpec],
    *,
    run_dir: Path,
    global_fields: Mapping[str, Any] | None = None,
    extra_roots: Iterable[Path] = (),
    head_server: bool = False,
    timeout_s: float = 180.0,
) -> GymServers:
    """Resolve ``specs`` into one config, start every server, and wait until each answers ``/``.

    Logs go to ``<run_dir>/<name>.log``. Arguments as for :func:`resolve_gym_config`; ``head_server``
    also starts Gym's head server (``GymServers.url("head_server")``) once the servers are up.

    Raises:
        ServiceError: resolution failed, or a server exited or was not healthy within ``timeout_s``
            seconds (the message has its log tail); the servers already started are stopped.
    """
    run_dir = Path(run_dir).resolve()
    config = resolve_gym_config(specs, run_dir=run_dir, global_fields=global_fields, extra_roots=extra_roots)
    processes: dict[str, ManagedProcess] = {}
    try:
        for spec in specs:
            processes[spec.name] = ManagedProcess(
                f"gym:{spec.name}",
                [str(gym_python()), spec.entrypoint],
                log_path=run_dir / f"{spec.name}.log",
                env=_gym_env(config.extra_roots, config=config, server_name=spec.name),
                cwd=config.server_dirs[spec.name],
            )
        for name, process in processes.items():
            wait_for_http(f"{config.url(name)}/", timeout_s=timeout_s, process=process)
        if head_server:
            processes[HEAD_SERVER_NAME] = ManagedProcess(
                "gym:head_server",
                [str(gym_python()), "-m", __name__, "head"],
                log_path=run_dir / f"{HEAD_SERVER_NAME}.log",
                env=_gym_env(config.extra_roots, config=config),
                cwd=run_dir,
            )
            wait_for_http(
                f"{config.url(HEAD_SERVER_NAME)}/health",
                timeout_s=timeout_s,
                process=processes[HEAD_SERVER_NAME],
            )
    except BaseException:
        for process in processes.values():
            process.stop()
        raise
    return GymServers(config, processes)


def _gym_env(
    roots: Sequence[Path], *, config: GymConfig | None = None, server_name: str | None = None
) -> dict[str, str]:
    """Environment for a process of the Gym environment's Python.

    ``PYTHONPATH`` is replaced, not extended: entries from the caller's environment (another Python
    version) must not leak into the Gym interpreter. A server gets its own directory on it, as
    ``gym env start`` does, so its ``app.py`` can import its sibling modules.
    """
    env = {
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": "",
        "NEMO_GYM_EXTRA_ROOTS": os.pathsep.join(map(str, roots)),
    }
    if config is not None:
        env["NEMO_GYM_CONFIG_DICT"] = config.yaml
    if server_name is not None and config is not None:
        env["NEMO_GYM_CONFIG_PATH"] = server_name
        env["PYTHONPATH"] = str(config.server_dirs[server_name])
    return env


def _resolver_env(roots: Sequence[Path]) -> dict[str, str]:
    """The full environment of the resolution step: ours, minus any config injected into us."""
    env = {key: value for key, value in os.environ.items() if key not in _INJECTED_CONFIG_VARS}
    env.update(_gym_env(roots))
    return env


def _json_default(value: object) -> str:
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"Gym config values must be JSON-serialisable, got {type(value).__name__}: {value!r}")


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


# --- Run in the Gym environment (python -m rl_bridge.services.gym_server ...) ---------------------------


def _resolve_in_gym_env(request_path: Path, result_path: Path) -> None:
    """Resolve the config in ``request_path`` with Gym's parser; write YAML, data and server dirs."""
    from nemo_gym import component_search_roots
    from nemo_gym.global_config import GlobalConfigDictParser, GlobalConfigDictParserConfig
    from omegaconf import OmegaConf

    request = json.loads(request_path.read_text())
    parse_config = GlobalConfigDictParserConfig(
        initial_global_config_dict=OmegaConf.create(request["config"]),
        skip_load_from_cli=True,
        skip_load_from_dotenv=True,
    )
    config = GlobalConfigDictParser().parse(parse_config)
    roots = component_search_roots()
    server_dirs: dict[str, str] = {}
    for name, by_type in request["config"].items():
        if not isinstance(by_type, dict) or not set(by_type) & set(SERVER_TYPES):
            continue
        ((server_type, by_implementation),) = by_type.items()
        ((implementation, fields),) = by_implementation.items()
        candidates = [root / server_type / implementation for root in roots]
        found = [path for path in candidates if (path / fields["entrypoint"]).is_file()]
        if not found:
            searched = "\n".join(f"  {path / fields['entrypoint']}" for path in candidates)
            raise SystemExit(f"Gym server {name!r}: no {server_type}/{implementation}. Searched:\n{searched}")
        server_dirs[name] = str(found[0])
    result = {
        "yaml": OmegaConf.to_yaml(config),
        "resolved": OmegaConf.to_container(config, resolve=True),
        "server_dirs": server_dirs,
    }
    result_path.write_text(json.dumps(result, indent=2))


def _run_head_server() -> None:
    """Serve the injected global config (``NEMO_GYM_CONFIG_DICT``) as Gym's head server, in the foreground."""
    import uvicorn
    from nemo_gym.server_utils import HeadServer, ServerClient

    server = HeadServer(config=ServerClient.load_head_server_config())
    app = server.setup_webserver()
    server.mark_ready()
    uvicorn.run(app, host=server.config.host, port=server.config.port)


def _main(argv: Sequence[str]) -> None:
    match list(argv):
        case ["resolve", request, result]:
            _resolve_in_gym_env(Path(request), Path(result))
        case ["head"]:
            _run_head_server()
        case _:
            raise SystemExit(
                f"usage: python -m {__spec__.name if __spec__ else __name__} resolve REQUEST RESULT | head"
            )


if __name__ == "__main__":
    _main(sys.argv[1:])
