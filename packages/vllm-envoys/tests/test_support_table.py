"""The availability table in the docs is the one the family declarations produce."""

from __future__ import annotations

from pathlib import Path

from vllm_envoys.support_table import families, replace_in, support_table

PAGE = Path(__file__).resolve().parents[3] / "docs" / "vllm-envoys.md"


def test_docs_table_matches_the_code() -> None:
    page = PAGE.read_text()
    assert replace_in(page) == page, (
        "docs/vllm-envoys.md is out of date: run python -m vllm_envoys.support_table "
        "docs/vllm-envoys.md")


def test_table_reflects_declared_reasons() -> None:
    rows = {line.split("|")[1].strip(" `"): line for line in support_table().splitlines()[2:]}
    columns = len(families())
    assert rows["mlp_activation"].count("✗") == columns - 1  # all but GPT-2's plain MLP
    # Every family but DeepSeek's latent attention serves queries; on the Transformers backend,
    # wherever attention is not MLA.
    assert rows["attention_queries"].count("✗") == 1
    # olmo2 and olmoe there, and the generic family
    assert rows["attention_queries"].count("✓ (not MLA)") == 3
    moe = {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v2",
           "olmoe (Transformers backend)"}
    assert rows["router_logits"].count("✓") == len(moe)
    assert {name for name, family in families() if family.mixture_of_experts} == moe
    assert rows["layer_mid"].count("✗") == 1  # Cohere's parallel block
