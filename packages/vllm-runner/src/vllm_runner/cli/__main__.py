"""`python -m vllm_runner.cli`: the `vllm-interp` command without its script."""

import sys

from vllm_runner.cli import main

sys.exit(main())
