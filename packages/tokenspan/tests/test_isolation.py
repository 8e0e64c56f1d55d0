"""tokenspan stays engine-agnostic: importing it loads no engine, model library or sibling."""

from __future__ import annotations

import json
import subprocess
import sys

FORBIDDEN = ("vllm", "transformers", "tpfragments", "vllm_envoys", "vllm_runner")


def test_import_pulls_in_no_engine_or_sibling() -> None:
    code = (
        "import sys, json, tokenspan; "
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    loaded = set(json.loads(subprocess.check_output([sys.executable, "-c", code], text=True)))
    assert "tokenspan" in loaded and "torch" in loaded
    assert not loaded & set(FORBIDDEN), f"tokenspan imported {sorted(loaded & set(FORBIDDEN))}"
