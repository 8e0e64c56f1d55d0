"""The user guide's examples run: every ```python block of docs/vllm-runner.md is executed in
order, in one namespace, on the tiny model (as `MODEL`), in a fresh process — so the page
cannot drift from the code."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

GUIDE = Path(__file__).parents[3] / "docs" / "vllm-runner.md"

RUNNER = """
import re, sys, traceback
blocks = re.findall(r"^```python\\n(.*?)^```", open(sys.argv[1]).read(), re.S | re.M)
namespace = {"MODEL": sys.argv[2], "__name__": "__main__"}
for number, block in enumerate(blocks, 1):
    try:
        exec(compile(block, f"guide block {number}", "exec"), namespace)
    except BaseException:
        print(f"GUIDE FAILED in block {number}:\\n{block}", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
print(f"GUIDE OK {len(blocks)}")
"""


def test_every_guide_example_runs(model_dir: str) -> None:
    blocks = re.findall(r"^```python\n", GUIDE.read_text(), re.M)
    assert len(blocks) >= 10, "the guide lost its examples"
    environment = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                   "VLLM_CPU_KVCACHE_SPACE": "1"}  # beside the fixture engine, a small cache
    completed = subprocess.run([sys.executable, "-c", RUNNER, str(GUIDE), model_dir],
                               env=environment, capture_output=True, text=True, timeout=600)
    assert f"GUIDE OK {len(blocks)}" in completed.stdout, completed.stderr[-5000:]
