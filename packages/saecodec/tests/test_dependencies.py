"""The package imports and computes with torch alone (issue [P]: usable in other engines);
safetensors, its one other dependency, is needed only to read or write files."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
for name in ("safetensors", "numpy", "sae_lens", "transformers", "vllm"):
    sys.modules[name] = None  # importing any of them now fails
import torch
from saecodec import SAE
sae = SAE("jumprelu", torch.randn(8, 32), torch.zeros(32), torch.randn(32, 8), torch.zeros(8),
          threshold=torch.full((32,), 0.1))
features = sae.encode(torch.randn(3, 8))
assert features.shape == (3, 32) and sae.decode(features).shape == (3, 8)
print("ok")
"""


def test_the_package_imports_and_encodes_with_torch_alone() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
