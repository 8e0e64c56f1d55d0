"""The seam to the engine: the runtime, its plan, hooks, serving, ops and store run without
vLLM, so a second engine adapter (vLLM's V2 runner) needs no change to them."""

from __future__ import annotations

import subprocess
import sys

ENGINE_FREE = ("vllm_runner.runtime.runtime", "vllm_runner.runtime.step_plan",
               "vllm_runner.runtime.hooks", "vllm_runner.runtime.row_serving", "vllm_runner.ops",
               "vllm_runner.ops.program",
               "vllm_runner.saves.store", "vllm_runner.runtime.lens", "vllm_runner.runtime.sharded")


def test_the_runtime_and_its_parts_import_nothing_from_vllm() -> None:
    """Imported in a fresh interpreter, none of them loads a `vllm` module."""
    script = (f"import sys\nimport {', '.join(ENGINE_FREE)}\n"
              "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))")
    found = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           check=True)
    assert found.stdout.strip() == "[]", found.stdout
