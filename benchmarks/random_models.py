"""Random-weight checkpoints of real models' shapes, and random SAEs, for benchmarks and
GPU checks.

No weights can be downloaded here or on the lent GPU, and speed depends on shapes, not on
trained values: a random model of SmolLM2-135M's or Llama-3.2-1B's shape costs what the real one
costs. `tiny` is for fast runs on CPU. A checkpoint may also be its config alone
(`weights=False`), for vLLM's `load_format="dummy"`, which fills the weights itself: a model of
Llama-3.1-8B's shape then starts without 16 GB written to disk and read back.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

SHAPES = {
    "tiny": dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 tie_word_embeddings=False),
    # Thin and deep: a forward that costs little, so a benchmark sees its per-layer host work.
    "thin-30": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=30,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                    tie_word_embeddings=False),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, tie_word_embeddings=True, rope_theta=100000.0),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, tie_word_embeddings=True, rope_theta=500000.0),
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, tie_word_embeddings=False, rope_theta=500000.0),
    # Qwen3-30B-A3B's layer (128 experts, 8 a token), 12 of its 48 layers: 16 GB in bf16, so
    # vLLM's default engine and ours fit one 80 GB GPU side by side. A layer costs what the
    # full model's does; the model's cost per token is a quarter.
    "qwen3-30b-a3b-12l": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
                              intermediate_size=6144, moe_intermediate_size=768,
                              num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                              num_hidden_layers=12, num_attention_heads=32,
                              num_key_value_heads=4, head_dim=128, tie_word_embeddings=False,
                              rope_theta=1000000.0),
    "tiny-moe": dict(model_type="qwen3_moe", vocab_size=256, hidden_size=128,
                     intermediate_size=256, moe_intermediate_size=64, num_experts=8,
                     num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, tie_word_embeddings=False),
}


def random_checkpoint(shape: str, folder: str | Path, dtype: torch.dtype = torch.bfloat16,
                      device: str = "cpu", weights: bool = True) -> str:
    """Save a random model of `shape` (a key of `SHAPES`; a Llama unless it names another
    `model_type`) into `folder` once; return its path.

    Weights are drawn with a fixed seed at a scale (std 0.02, transformers' own init) that keeps
    bf16 activations finite through every layer. `weights=False` saves the config alone (for
    `load_format="dummy"`)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    path = Path(folder) / f"random-{shape}"
    if (path / "config.json").exists():
        return str(path)
    torch.manual_seed(0)
    fields = dict(SHAPES[shape])
    model_type = fields.pop("model_type", "llama")
    # The causal-LM class named, as a real checkpoint's config does: without it vLLM may take
    # the model for another task.
    config = AutoConfig.for_model(model_type, max_position_embeddings=4096, rms_norm_eps=1e-5,
                                  architectures=[MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]],
                                  **fields)
    if weights:
        with torch.device(device):  # initialising 1B parameters on a GPU takes a second
            model = AutoModelForCausalLM.from_config(config).to(dtype)
        model.save_pretrained(path, safe_serialization=True)
    else:
        config.dtype = dtype
        config.save_pretrained(path)
    # A generation config without sampling defaults, so both engines sample the same way.
    (path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    return str(path)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every benchmark takes to pick its model: a checkpoint (`--model`), or a
    random one of a real shape (`--shape`), and the dtype."""
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--shape", default=None, choices=sorted(SHAPES),
                        help="instead of --model: a random model of this shape")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])


def random_sae_folder(hidden: int, width: int, layer: int,
                      dtype: torch.dtype = torch.float32) -> str:
    """A random JumpReLU SAE of `width` features reading layer `layer`'s output of a model
    `hidden` wide, in SAELens's format and `dtype`, in a new temporary folder. Speed depends on
    its shape and dtype, not its values."""
    import tempfile

    from saecodec import SAE, Site

    generator = torch.Generator().manual_seed(1)
    sae = SAE("jumprelu", torch.randn(hidden, width, generator=generator) / hidden ** 0.5,
              torch.zeros(width), torch.randn(width, hidden, generator=generator) / hidden ** 0.5,
              torch.zeros(hidden), threshold=torch.full((width,), 0.5),
              site=Site(hook_name=f"blocks.{layer}.hook_resid_post")).to(dtype=dtype)
    folder = tempfile.mkdtemp()
    sae.save(folder)
    return folder
