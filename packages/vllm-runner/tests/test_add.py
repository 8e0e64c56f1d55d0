"""Add (steering): the steered request generates what transformers generates with the same edit,
and nobody else changes — in the same step, or later through the prefix cache."""

from __future__ import annotations

import pytest
import torch
from conftest import GENERATED, PROMPTS
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import ops

LAYER = 1


@torch.no_grad()
def steered_greedy(model, prompt: list[int], count: int, vector: torch.Tensor | None,
                   ablated: torch.Tensor | None = None):
    """transformers' greedy tokens with `vector` added to one layer's output at every position,
    after its component along `ablated` (if any) is taken out."""
    handle = None
    if vector is not None or ablated is not None:
        def edited(hidden: torch.Tensor) -> torch.Tensor:
            if ablated is not None:
                unit = ablated / ablated.norm()
                hidden = hidden - (hidden @ unit).unsqueeze(-1) * unit
            return hidden if vector is None else hidden + vector

        def add(module, args, output):
            if isinstance(output, tuple):
                return (edited(output[0]), *output[1:])
            return edited(output)
        handle = model.model.layers[LAYER].register_forward_hook(add)
    try:
        tokens = list(prompt)
        for _ in range(count):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
        return tokens[len(prompt):]
    finally:
        if handle is not None:
            handle.remove()


@pytest.fixture(scope="module")
def vector() -> torch.Tensor:
    return torch.randn(128, generator=torch.Generator().manual_seed(7)) * 3.0


def generate(llm, prompt: list[int], interventions=None) -> list[int]:
    (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                             SamplingParams(max_tokens=GENERATED, temperature=0.0),
                             interventions=interventions, use_tqdm=False)
    return list(output.outputs[0].token_ids)


def test_steered_request_matches_transformers_and_others_are_untouched(llm, reference,
                                                                        vector) -> None:
    steer = [ops.Add(f"layers.{LAYER}.layer_output", vector, scale=2.0)]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=GENERATED, temperature=0.0),
                           interventions=[steer, [], steer], use_tqdm=False)
    for index, output in enumerate(outputs):
        edit = 2.0 * vector if index != 1 else None
        expected = steered_greedy(reference, PROMPTS[index], GENERATED, edit)
        assert list(output.outputs[0].token_ids) == expected, f"request {index}"
    plain = steered_greedy(reference, PROMPTS[0], GENERATED, None)
    assert steered_greedy(reference, PROMPTS[0], GENERATED, 2.0 * vector) != plain, (
        "the steering vector is too weak to test anything")


def test_steering_never_leaks_through_the_prefix_cache(llm, reference, vector) -> None:
    # A prompt no other test uses, steered first: its KV blocks would be cached, and a plain
    # request for the same prompt would reuse them without the per-program cache salt.
    prompt = [(7 * i + 3) % 256 for i in range(66)]  # two whole 32-token KV blocks
    steered = generate(llm, prompt, [ops.Add(f"layers.{LAYER}.layer_output", vector, 2.0)])
    plain = generate(llm, prompt)
    assert plain == steered_greedy(reference, prompt, GENERATED, None)
    assert steered == steered_greedy(reference, prompt, GENERATED, 2.0 * vector) != plain


def test_steering_never_leaks_to_requests_with_the_callers_own_cache_salt(
        llm, reference, vector, monkeypatch) -> None:
    # A salt the caller gives (vLLM's per-tenant cache isolation) must not replace the
    # program's: a plain request with the same salt would read the steered blocks.
    prompt = [(11 * i + 5) % 256 for i in range(66)]  # two whole 32-token KV blocks
    def run(interventions):
        (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt, cache_salt="tenant")],
                                 SamplingParams(max_tokens=GENERATED, temperature=0.0),
                                 interventions=interventions, use_tqdm=False)
        return output
    sent = []
    engine_generate = llm.engine.generate

    def recording(requests, *args, **kwargs):
        sent.extend(request.get("cache_salt") for request in requests)
        return engine_generate(requests, *args, **kwargs)

    monkeypatch.setattr(llm.engine, "generate", recording)
    steered = run([ops.Add(f"layers.{LAYER}.layer_output", vector, 2.0)])
    plain, again = run(None), run(None)
    assert sent[0].startswith("tenant/") and sent[1:] == ["tenant", "tenant"]
    assert list(plain.outputs[0].token_ids) == steered_greedy(reference, prompt, GENERATED,
                                                              None)
    assert list(steered.outputs[0].token_ids) != list(plain.outputs[0].token_ids)
    assert again.num_cached_tokens == 64  # the caller's salt still shares plain blocks


def test_positions_limit_where_the_vector_is_added(llm, reference, vector) -> None:
    # Only at generated positions: the prompt's saved stream must be unchanged.
    location = f"layers.{LAYER}.layer_output"
    plain, steered = (
        llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[0])],
                     SamplingParams(max_tokens=GENERATED, temperature=0.0),
                     interventions=program, use_tqdm=False)[0]
        for program in ([ops.Save(location)],
                        [ops.Add(location, vector, steps="decode"), ops.Save(location)]))
    prompt_length = len(PROMPTS[0])
    assert torch.allclose(steered.saved[location][:, :prompt_length],
                          plain.saved[location][:, :prompt_length], atol=1e-6)
    assert not torch.allclose(steered.saved[location][:, prompt_length:],
                              plain.saved[location][:, prompt_length:], atol=1e-3)


def test_a_failing_op_fails_only_its_request_and_the_engine_keeps_serving(llm, reference,
                                                                           vector) -> None:
    wrong = [ops.Add(f"layers.{LAYER}.layer_output", torch.ones(7))]  # hidden is 128
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS[:2]],
                           SamplingParams(max_tokens=GENERATED, temperature=0.0),
                           interventions=[wrong, [ops.Save("layers.0.layer_output")]],
                           use_tqdm=False)
    assert "add at layers.1.layer_output" in outputs[0].error
    assert outputs[1].error is None and "layers.0.layer_output" in outputs[1].saved
    assert list(outputs[1].outputs[0].token_ids) == steered_greedy(reference, PROMPTS[1],
                                                                    GENERATED, None)
    # Every position of the other request saved, also at the steps after its neighbour failed
    # (a failure makes the adapter find each request's program again: `repeated_schedule`).
    sequence = PROMPTS[1] + list(outputs[1].outputs[0].token_ids)[:-1]
    with torch.no_grad():
        expected = reference(torch.tensor([sequence]), output_hidden_states=True).hidden_states[1]
    saved = outputs[1].saved["layers.0.layer_output"]
    assert saved.shape == expected.shape
    assert (saved - expected).abs().max() / expected.abs().max() <= 1e-4
    assert generate(llm, PROMPTS[0]) == steered_greedy(reference, PROMPTS[0], GENERATED, None)
