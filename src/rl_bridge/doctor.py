"""``video-grpo doctor``: check that the environments hold what each process role needs."""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

from rl_bridge.paths import gym_python

__all__ = ["Check", "run_checks"]


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def _version_of(module: str) -> Callable[[], str]:
    def probe() -> str:
        mod = importlib.import_module(module)
        return str(getattr(mod, "__version__", "imported"))

    return probe


def _vllm_plugin_entry_point() -> str:
    names = {ep.name: ep.value for ep in metadata.entry_points(group="vllm.general_plugins")}
    from vllm_video_plugin import PLUGIN_NAME

    if PLUGIN_NAME not in names:
        raise LookupError(f"{PLUGIN_NAME!r} not in vllm.general_plugins entry points: {sorted(names)}")
    return f"{PLUGIN_NAME} -> {names[PLUGIN_NAME]}"


def _megatron_bridge() -> str:
    from rl_bridge.megatron.te_standin import import_megatron_bridge

    bridge = import_megatron_bridge()
    return metadata.version("megatron-bridge") + f" ({bridge.__name__})"


def _gym_env() -> str:
    python = gym_python()
    if not python.exists():
        raise FileNotFoundError(f"{python} does not exist; run scripts/setup")
    out = subprocess.run(
        [str(python), "-c", "import nemo_gym, gym_video_env; print(nemo_gym.__version__)"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "failed")
    return f"nemo_gym {out.stdout.strip()} at {python}"


def _gym_config() -> str:
    """Gym's own parser, in the Gym environment, resolves this package's video model server as the
    trainer hands it over (its search roots), as every run's first Gym step does."""
    import tempfile
    from pathlib import Path

    from rl_bridge.paths import gym_search_roots
    from rl_bridge.services.gym_server import resolve_gym_config, video_model_server_spec

    with tempfile.TemporaryDirectory(prefix="video-grpo-doctor-") as tmp:
        spec = video_model_server_spec(
            "video_model", openai_url="http://127.0.0.1:9/v1", model="policy", media_root=tmp
        )
        config = resolve_gym_config([spec], run_dir=Path(tmp) / "gym", extra_roots=gym_search_roots())
        return f"{spec.name} resolved, from {config.server_dirs[spec.name]}"


def _run(name: str, probe: Callable[[], str]) -> Check:
    try:
        return Check(name, True, probe())
    except Exception as exc:  # noqa: BLE001 - a doctor reports every failure, whatever its type
        return Check(name, False, f"{type(exc).__name__}: {exc}")


def run_checks(*, verbose: bool = False) -> bool:
    """Run every check, print one line per check, return whether all passed.

    What the libraries print while they are imported (Apex and Transformer Engine fallbacks,
    Megatron-Bridge's optional-symbol tracebacks) goes to ``.cache/doctor/logs/trainer.log``, named
    under the table; ``verbose`` leaves it on the console and prints each check's whole detail."""
    from rl_bridge.console import attach_run_log, capture, stdout_to_run_log
    from rl_bridge.paths import cache_dir

    log = None
    if not verbose:
        capture()
        log = attach_run_log(cache_dir("doctor"))
    with stdout_to_run_log():
        checks = [
            _run("torch", _version_of("torch")),
            _run("transformers", _version_of("transformers")),
            _run("av (PyAV)", _version_of("av")),
            _run("vllm", _version_of("vllm")),
            _run("vllm plugin entry point", _vllm_plugin_entry_point),
            _run("megatron.core", _version_of("megatron.core")),
            _run("megatron.bridge", _megatron_bridge),
            _run("gym environment", _gym_env),
            _run("gym config", _gym_config),
        ]
    width = max(len(c.name) for c in checks)
    for c in checks:
        detail = c.detail if (verbose or not c.ok) else c.detail.splitlines()[0][:100]
        print(f"{'ok  ' if c.ok else 'FAIL'} {c.name:<{width}}  {detail}")
    if log is not None:
        print(f"(what the libraries printed while importing: {log})")
    return all(c.ok for c in checks)
