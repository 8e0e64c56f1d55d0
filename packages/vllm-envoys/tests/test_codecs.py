"""Reading and writing values on stand-in modules (no engine): layouts, refused writes,
availability, and streams rebuilt exactly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from vllm_envoys import FusedLayer, HookArgs, ReadOnly, Step, Unavailable, ValueShapeError
from vllm_envoys.families.gpt2 import Gpt2Layer


class StandInAttention(nn.Module):
    """The attributes of vLLM's `Attention` layer that values read (4 heads of 32, 2 kv heads)."""

    head_size = 32
    num_heads = 4
    num_kv_heads = 2
    sliding_window = None
    impl = SimpleNamespace(scale=32**-0.5, logits_soft_cap=None)

    def forward(self, query, key, value):
        return query


def stand_in_layer(mlp_children: dict[str, nn.Module], attention_name: str = "self_attn",
                   mid: str = "post_attention_layernorm") -> nn.Module:
    attention = nn.Module()
    attention.attn = StandInAttention()
    mlp = nn.Module()
    for name, child in mlp_children.items():
        setattr(mlp, name, child)
    layer = nn.Module()
    setattr(layer, attention_name, attention)
    layer.mlp = mlp
    setattr(layer, mid, nn.Identity())
    return layer


@pytest.fixture
def fused() -> FusedLayer:
    return FusedLayer(stand_in_layer({"down_proj": nn.Identity()}), "layers.0")


def qkv(tokens: int) -> HookArgs:
    return HookArgs((torch.randn(tokens, 128), torch.randn(tokens, 64), torch.randn(tokens, 64)),
                    {})


def test_heads_are_split_by_the_modules_head_size(fused: FusedLayer) -> None:
    raw = qkv(3)
    queries = fused.self_attn.attention_queries.read(raw)
    keys = fused.self_attn.attention_keys.read(raw)
    assert queries.shape == (1, 4, 3, 32) and keys.shape == (1, 2, 3, 32)
    assert torch.equal(queries[0, 1, 2], raw.args[0][2, 32:64])  # head 1, token 2
    head_outputs = fused.self_attn.attention_head_outputs.read(torch.randn(3, 128))
    assert head_outputs.shape == (1, 3, 4, 32)


def test_reads_are_private_copies(fused: FusedLayer) -> None:
    raw = qkv(3)
    queries = fused.self_attn.attention_queries.read(raw)
    raw.args[0].zero_()  # what an in-place kernel does after the read
    assert torch.count_nonzero(queries) > 0


def test_views_share_the_engine_rows_where_the_value_is_not_computed(fused) -> None:
    raw = qkv(3)
    attention = fused.self_attn
    for value in (attention.attention_queries, attention.attention_values):
        view = value.view(raw)
        assert torch.equal(view, value.read(raw))
        view.mul_(2.0)  # lands in the engine's tensor at once
        assert torch.equal(value.read(raw), view)
    hidden, residual = torch.randn(3, 128), torch.randn(3, 128)
    assert fused.layer_input.view(HookArgs((None, hidden, residual), {})) is None  # a sum
    view = fused.layer_input.view(HookArgs((None, hidden, None), {}))
    assert view is not None and view.data_ptr() == hidden.data_ptr()
    assert attention.attention_probabilities.view(raw, Step(0, 3, 3)) is None  # recomputed


def test_wrong_shape_write_is_refused_and_a_read_written_back_is_unchanged(fused) -> None:
    raw = qkv(3)
    queries = fused.self_attn.attention_queries
    value = queries.read(raw)
    with pytest.raises(ValueShapeError, match=r"expected a tensor of shape \(1, 4, 3, 32\)"):
        queries.write(raw, value[:, :, :2])
    assert torch.equal(queries.write(raw, value).args[0], raw.args[0])


def test_pattern_needs_every_earlier_key_and_is_read_only(fused: FusedLayer) -> None:
    raw = qkv(3)
    pattern = fused.self_attn.attention_probabilities
    with pytest.raises(Unavailable, match="keys of every earlier position"):
        pattern.read(raw, Step(first_position=5, tokens=1, prompt_length=5))
    probabilities = pattern.read(raw, Step(first_position=0, tokens=3, prompt_length=3))
    assert probabilities.shape == (1, 4, 3, 3)
    assert torch.allclose(probabilities.sum(-1), torch.ones(1, 4, 3))
    assert torch.count_nonzero(torch.triu(probabilities[0], diagonal=1)) == 0  # causal
    with pytest.raises(ReadOnly, match="derived and read-only"):
        pattern.write(raw, probabilities, Step(0, 3, 3))


def test_gated_mlp_has_no_activation_with_a_reason(fused: FusedLayer) -> None:
    with pytest.raises(Unavailable, match=r"layers.0.mlp.mlp_activation is unavailable: .*gated"):
        fused.mlp.mlp_activation.read(torch.zeros(2, 8))


def test_fused_stream_write_rebuilds_the_stream_exactly(fused: FusedLayer) -> None:
    output = fused.layer_output
    hidden, residual = torch.randn(4, 128), torch.randn(4, 128)
    stream = output.read((hidden, residual))
    assert torch.equal(stream[0], hidden + residual)
    new_hidden, new_residual = output.write((hidden, residual), stream * 2)
    assert torch.equal(new_hidden + new_residual, stream[0] * 2)
    assert torch.count_nonzero(new_residual) == 0
    first = fused.layer_input  # before the first block the residual half is None
    raw = HookArgs((torch.arange(4), hidden, None), {})
    assert torch.equal(first.read(raw)[0], hidden)
    assert first.write(raw, first.read(raw) + 1).args[2] is None


def test_stream_block_mid_is_read_only_and_says_what_to_edit() -> None:
    layer = Gpt2Layer(stand_in_layer({"c_proj": nn.Identity()}, "attn", "ln_2"), "layers.0")
    stream = torch.randn(4, 128)
    assert torch.equal(layer.layer_output.write(stream, layer.layer_output.read(stream)), stream)
    with pytest.raises(ReadOnly, match="read-only"):
        layer.layer_mid.write(HookArgs((stream,), {}), stream.unsqueeze(0))
    assert "attention_output" in layer.eproperties()["layer_mid"].description


def test_rowwise_codecs_read_a_slab_as_the_concatenation_of_its_row_runs() -> None:
    """What lets a runner read (and write) a value once for many requests and hand each its
    rows."""
    from tokenspan import StepLayout, narrow
    from vllm_envoys import Heads, Rows, Stream
    from vllm_envoys.codecs import Probabilities

    layout = StepLayout.from_counts("abc", [2, 5, 1], [0, 0, 0])
    cases = [  # (codec, a raw piece of 8 rows, the tokens axis of what it decodes to)
        (Rows(), torch.randn(8, 128), 1),
        (Rows(batched=True), torch.randn(1, 8, 128), 1),
        (Stream(), (torch.randn(8, 128), torch.randn(8, 128)), 1),
        (Stream(), torch.randn(8, 128), 1),
        (Heads(lambda module: 32, heads_first=True), torch.randn(8, 128), 2),
        (Heads(lambda module: 32, heads_first=False), torch.randn(8, 128), 1),
        (Probabilities(), torch.randn(8, 128), 1),
    ]
    for codec, piece, axis in cases:
        assert codec.rowwise
        whole = codec.decode(piece, nn.Identity())
        parts = [codec.decode(narrow(piece, layout[key], layout), nn.Identity())
                 for key in "abc"]
        assert torch.equal(whole, torch.cat(parts, dim=axis)), type(codec).__name__
        if not codec.writable:
            continue
        edited = torch.randn_like(whole)  # written back once for the slab, or run by run
        slab = codec.encode(piece, nn.Identity(), edited)
        runs = [codec.encode(narrow(piece, layout[key], layout), nn.Identity(), part)
                for key, part in zip("abc", edited.split([2, 5, 1], dim=axis), strict=True)]
        for index, leaf in enumerate(slab if isinstance(slab, tuple) else (slab,)):
            pieces = [run[index] if isinstance(run, tuple) else run for run in runs]
            rows_axis = list(leaf.shape).index(8)  # the raw piece's own tokens axis
            assert torch.equal(leaf, torch.cat(pieces, dim=rows_axis)), type(codec).__name__


def test_later_queries_against_every_key_are_the_rows_of_the_whole_pattern(
        fused: FusedLayer) -> None:
    """A chunk or a decode step (its queries, with the keys of every position up to its last)
    gives the rows of the pattern of the whole sequence, scores and probabilities (to float
    rounding: the products are taken in other shapes)."""
    whole = qkv(7)
    query, key = whole.args[0], whole.args[1]
    for name in ("attention_scores", "attention_probabilities"):
        pattern = getattr(fused.self_attn, name)
        full = pattern.read(whole, Step(0, 7, 7))
        for first, tokens in ((4, 3), (6, 1), (2, 2)):
            later = HookArgs((query[first:first + tokens], key[:first + tokens],
                              whole.args[2][first:first + tokens]), {})
            rows = pattern.read(later, Step(first, tokens, 7, earlier_keys=True))
            assert rows.shape == (1, 4, tokens, first + tokens)
            assert torch.allclose(rows, full[:, :, first:first + tokens, :first + tokens],
                                  atol=1e-6)
