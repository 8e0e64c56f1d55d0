"""What the server checks before queueing from the values' shapes (`value_shapes`): a vector is
refused exactly when torch's broadcasting could not fit it at any token count, and the bound on
a request's saves is what the engine's own saves take when every token is generated."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import ops
from vllm_runner.server.value_shapes import (
    ValueShape,
    check_tensors_fit,
    misfit,
    saved_bytes_bound,
    shapes_from_saves,
)

SIZES = st.sampled_from([1, 2, 3, 4])


def fits_some_step(given_shape: tuple[int, ...], value: ValueShape) -> bool:
    """torch's answer: the tensor broadcasts over the value at some token count (the counts a
    step could have that matter: 1, and the tensor's own extent along the tokens axis)."""
    counts = {1, 2}
    offset = len(value.shape) - value.token_axis
    if len(given_shape) >= offset:
        counts.add(given_shape[-offset])
    for count in counts:
        step = list(value.shape)
        step[value.token_axis] = count
        try:
            if torch.broadcast_shapes(given_shape, tuple(step)) == tuple(step):
                return True
        except RuntimeError:
            pass
    return False


@settings(max_examples=300, deadline=None)
@given(st.lists(SIZES, min_size=1, max_size=3), st.integers(0, 3),
       st.lists(SIZES, min_size=0, max_size=5))
def test_a_vector_is_refused_exactly_when_torch_could_not_broadcast_it(
        sizes: list[int], tokens_at: int, vector: list[int]) -> None:
    tokens_at = min(tokens_at, len(sizes))
    layout = ["batch", *[f"axis{i}" for i in range(len(sizes))]]
    layout.insert(1 + tokens_at, "tokens")
    shape = [1, *sizes]
    shape.insert(1 + tokens_at, 1)
    value = ValueShape(tuple(layout), tuple(shape))
    op = ops.Add("layers.0.layer_output", torch.zeros(vector))
    reason = misfit(op, op.vector, "layers.0.layer_output", value)
    assert (reason is None) == fits_some_step(tuple(vector), value), reason


RESIDUAL = ValueShape(("batch", "tokens", "hidden"), (1, 1, 8))


@pytest.mark.parametrize(("direction", "fits"), [([8], True), ([1, 8], False), ([4], False)])
def test_a_direction_is_one_vector_along_the_last_axis(direction: list[int], fits: bool) -> None:
    op = ops.ProjectOut("layers.0.layer_output", torch.ones(direction))
    assert (misfit(op, op.direction, "layers.0.layer_output", RESIDUAL) is None) == fits


def test_the_first_misfit_names_its_op_and_field_and_the_size_to_give() -> None:
    shapes = {"layers.0.layer_output": RESIDUAL, "layers.1.layer_output": RESIDUAL,
              "layers.1.mlp_neurons": ValueShape(("batch", "tokens", "intermediate"),
                                                 (1, 1, 16))}
    program = [ops.Save("layers.0.layer_output"), ops.Add("layers.*.layer_output", torch.ones(8)),
               ops.Set("layers.1.mlp_neurons", torch.ones(8))]
    located = [["layers.0.layer_output"], ["layers.0.layer_output", "layers.1.layer_output"],
               ["layers.1.mlp_neurons"]]
    field, message = check_tensors_fit(program, located, shapes) or ("", "")
    assert field == "interventions[2].value"
    assert "[8]" in message and "[1 tokens 16]" in message and "give e.g. [16]" in message
    # A location whose shape was not learned is left to the worker's check at each step.
    assert check_tensors_fit(program, located, {}) is None


def test_every_saved_value_gets_its_shape_and_a_pattern_is_left_to_the_worker() -> None:
    layouts = {"layers.0.layer_output": ["batch", "tokens", "hidden"],
               "layers.0.attention_probabilities": ["batch", "heads", "query", "key"]}
    saved = {"layers.0.layer_output": torch.zeros(1, 1, 8),
             "layers.0.attention_probabilities": torch.zeros(1, 4, 1, 1, dtype=torch.bfloat16)}
    shapes = shapes_from_saves(layouts, saved)
    assert shapes["layers.0.layer_output"] == RESIDUAL
    pattern = shapes["layers.0.attention_probabilities"]
    assert pattern.token_axis is None and pattern.bytes_per_row() == 4 * 2
    op = ops.Set("layers.0.attention_probabilities", torch.zeros(3))
    assert misfit(op, op.value, "layers.0.attention_probabilities", pattern) is None


def _learned_shapes(llm) -> dict[str, ValueShape]:
    """Every value's shape, learned as the server learns them: one request of one token that
    saves every value."""
    (layouts, *_) = llm.collective_rpc("interp_layouts")
    (probe,) = llm.generate([TokensPrompt(prompt_token_ids=[0])],
                            SamplingParams(max_tokens=1, temperature=0.0),
                            interventions=[ops.Save(location) for location in layouts],
                            use_tqdm=False)
    return shapes_from_saves(layouts, probe.saved)


def test_the_bound_is_what_the_saves_take_when_every_token_is_generated(llm) -> None:
    """The oracle is the engine's own saves: shapes learned as the server learns them (one
    request of one token saving every value), then programs run to `max_tokens`."""
    shapes = _learned_shapes(llm)
    prompt, generated = [5, 17, 99, 3, 42], 4  # one step's prompt: patterns are served
    programs = [
        [ops.Save("layers.*.layer_output")],
        [ops.Save("layers.0.mlp_neurons", positions=(0, -1, 6)),
         ops.Save("layers.1.attention_queries", steps="decode")],
        [ops.Save("logits"), ops.Save("layers.2.attention_keys", steps="prefill")],
        [ops.Save("layers.0.attention_probabilities"), ops.Save("logits", steps="decode"),
         ops.Add("layers.1.layer_output", torch.zeros(128))],
        # What the ops that compute from the rows keep: a lens's top-k, a probe's scores, an
        # SAE's features (a TopK SAE's `k` when asked for every active one).
        [ops.Lens("layers.*.layer_output", top_k=7, positions=(-1, 1)),
         ops.Probe("layers.1.layer_output", torch.ones(3, 128), steps="decode"),
         ops.Probe("layers.0.layer_output", torch.ones(128))],
        [ops.Features(sae="res1", top_k=6), ops.Features(sae="mlp0"),
         ops.Features(sae="pre2", top_k=5, steps="prefill")],
    ]
    patterns = sorted({pattern for program in programs for op in program
                       for pattern in op.patterns()})
    (resolved, *_) = llm.collective_rpc("interp_resolve", args=(patterns,))
    for program in programs:
        (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                                 SamplingParams(max_tokens=generated, temperature=0.0,
                                                ignore_eos=True),
                                 interventions=program, use_tqdm=False)
        assert output.error is None, output.error
        taken = sum(tensor.numel() * tensor.element_size() for tensor in output.saved.values())
        located = [[location for pattern in op.patterns()
                    for location in resolved["resolved"][pattern]] for op in program]
        assert saved_bytes_bound(program, located, shapes, len(prompt), generated,
                                 llm.saes) == taken


def test_every_active_feature_of_an_unbounded_sae_is_bounded_by_all_its_features(llm) -> None:
    """A JumpReLU SAE's active features per token are known only as it runs: the bound counts
    every feature at every row (int64 indices, float32 values), and what it keeps is less."""
    shapes = _learned_shapes(llm)
    program = [ops.Features(sae="res1")]
    (resolved, *_) = llm.collective_rpc("interp_resolve", args=(["sae:res1"],))
    located = [resolved["resolved"]["sae:res1"]]
    (output,) = llm.generate([TokensPrompt(prompt_token_ids=[5, 17, 99])],
                             SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                             interventions=program, use_tqdm=False)
    taken = sum(tensor.numel() * tensor.element_size() for tensor in output.saved.values())
    bound = saved_bytes_bound(program, located, shapes, 3, 3, llm.saes)
    assert bound == (3 + 2) * llm.saes["res1"]["d_sae"] * (8 + 4) > taken > 0
    assert saved_bytes_bound(program, located, shapes, 3, 3, {}) == 0  # no such SAE: refused
