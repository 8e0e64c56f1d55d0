"""Session fixtures: one tiny random Llama saved once, one engine and one HF oracle over it.

Engines take seconds to start on CPU, so every test shares them (ENVIRONMENT.md: a suite that
starts an engine per test does not fit CI).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

PROMPT = [5, 17, 99, 3, 42, 250, 7, 61, 8, 120, 33]
GENERATED = 4


def tiny_llama_config() -> LlamaConfig:
    """fp32, head_dim 32 (the CPU attention kernel's smallest), grouped-query attention."""
    return LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
        torch_dtype="float32",
    )


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    with torch.no_grad():  # random init is tiny; widen it so layers do visible work
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.08)
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="session")
def oracle(llama_dir: str):
    from hf_oracle import HFOracle

    return HFOracle(LlamaForCausalLM.from_pretrained(llama_dir, torch_dtype=torch.float32))


@pytest.fixture(scope="session")
def harness(llama_dir: str):
    from vllm_harness import EnvoyHarness, start_engine

    return EnvoyHarness(start_engine(llama_dir))
