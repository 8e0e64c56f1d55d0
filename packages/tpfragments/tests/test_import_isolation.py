"""`tpfragments` imports torch and nothing else heavy: not vLLM (its adapter imports vLLM only
when called), not transformers, not a sibling package."""

from __future__ import annotations

import json
import subprocess
import sys

FORBIDDEN = ("vllm", "transformers", "tokenspan", "vllm_envoys", "vllm_runner")


def test_importing_tpfragments_and_its_vllm_adapter_imports_no_vllm() -> None:
    script = (
        "import json, sys\n"
        "import tpfragments, tpfragments.vllm\n"
        "from tpfragments.vllm import fragments_for, rules_for, tp_group\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            check=True)
    modules = json.loads(result.stdout.strip().splitlines()[-1])
    assert "tpfragments.vllm" in modules and "torch" in modules
    leaked = [name for name in modules
              if any(name == root or name.startswith(root + ".") for root in FORBIDDEN)]
    assert leaked == []
