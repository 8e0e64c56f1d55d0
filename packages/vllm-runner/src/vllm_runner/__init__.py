"""vllm-runner: per-request interpretability programs inside vLLM's model runner.

`LLM` is vLLM's offline engine with `interventions=` on `generate`; `ops` holds what a program
can do. Programs travel as plain data in `SamplingParams.extra_args`, run on each request's own
rows inside the worker (tokenspan for rows, vllm-envoys for standard values), and saved values
come back per request.
"""

from importlib.metadata import PackageNotFoundError, version

from vllm_runner import ops
from vllm_runner.errors import InterpError, InterventionError, LocationError, UnsupportedEngine
from vllm_runner.llm import LLM

try:
    __version__ = version("vllm-runner")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["LLM", "InterpError", "InterventionError", "LocationError", "UnsupportedEngine",
           "__version__", "ops"]
