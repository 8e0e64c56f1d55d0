"""The SAELens side of `test_features`'s check against SAELens itself, run by the Python of an
environment holding SAELens (`VLLM_INTERP_SAELENS_PYTHON`: SAELens's pins do not fit vLLM's).

`python saelens_encode.py REQUEST.json`, where the request names a safetensors file of values
(`"values"`, each keyed `"<sae name>/<anything>"`, `[tokens, d_in]`), the SAEs' folders by name
(`"saes"`, SAELens's own format) and where to write (`"out"`): each value encoded by its SAE as
SAELens loads it (`SAE.load_from_disk`) and encodes it (`SAE.encode`), in float32, under the
value's key.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import sae_lens
import torch
from safetensors.torch import load_file, save_file


def main() -> None:
    request = json.loads(Path(sys.argv[1]).read_text())
    saes = {name: sae_lens.SAE.load_from_disk(folder, device="cpu")
            for name, folder in request["saes"].items()}
    encoded = {}
    with torch.no_grad():
        for key, values in load_file(request["values"]).items():
            sae = saes[key.split("/", 1)[0]]
            encoded[key] = sae.encode(values.to(sae.W_enc.dtype)).float().contiguous()
    save_file(encoded, request["out"])


if __name__ == "__main__":
    main()
