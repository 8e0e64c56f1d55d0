"""SAE features inside the engine (`LLM(saes=...)`): `Features` equals the SAE's encoding of
transformers' hidden states at its site; `SteerFeatures` equals transformers with the SAE's
decoder directions added by a hook; `ClampFeatures` equals transformers with the SAE's edit made
by hand, and clamping to the encoded value changes nothing. Bad input fails by name, alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import GENERATED, PROMPTS, SUITE_SAES, engine_script_environment, random_sae
from saecodec import SAE
from safetensors.torch import load_file, save_file
from test_lens import answers_of
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import LLM, LocationError, SAEsRefused, ops

TOLERANCE = 1e-4
#: The hidden state each suite SAE reads: (index into transformers' hidden states, or the MLP's
#: output of that layer).
SITES = {"res1": ("hidden", 2), "mlp0": ("mlp", 0), "pre2": ("hidden", 2)}


@pytest.fixture(scope="module")
def saes(sae_dirs) -> dict[str, SAE]:
    return {name: SAE.load(path) for name, path in sae_dirs.items()}


def _run(llm, programs, prompts=PROMPTS, **sampling):
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(max_tokens=GENERATED, temperature=0.0, **sampling),
                        interventions=programs, use_tqdm=False)


@torch.no_grad()
def site_values(reference, tokens: list[int], name: str) -> torch.Tensor:
    """transformers' value at SAE `name`'s site over `tokens`: `[tokens, 128]`."""
    kind, index = SITES[name]
    if kind == "hidden":
        return reference(torch.tensor([tokens]), output_hidden_states=True).hidden_states[index][0]
    found = []
    handle = reference.model.layers[index].mlp.register_forward_hook(
        lambda module, args, output: found.append(output))
    try:
        reference(torch.tensor([tokens]))
    finally:
        handle.remove()
    return found[0][0]


def dense(indices: torch.Tensor, values: torch.Tensor, d_sae: int) -> torch.Tensor:
    """`[1, tokens, k]` indices and values (-1: none) as dense `[tokens, d_sae]` features."""
    out = torch.zeros(indices.shape[1], d_sae + 1)
    out.scatter_(1, indices[0].clamp(min=-1) % (d_sae + 1), values[0].float())
    return out[:, :d_sae]


def test_the_engine_says_where_each_sae_reads(llm) -> None:
    assert llm.saes["res1"]["location"] == "layers.1.layer_output"
    assert llm.saes["mlp0"]["location"] == "layers.0.mlp.mlp_output"  # canonical
    assert llm.saes["pre2"]["location"] == "layers.2.layer_input"
    assert {name: found["architecture"] for name, found in llm.saes.items()} == {
        name: architecture for name, (architecture, _, _) in SUITE_SAES.items()}
    assert llm.resolve(["sae:res1"]) == {"sae:res1": ["layers.1.layer_output"]}


@pytest.mark.parametrize(("name", "top_k"), [("res1", 16), ("mlp0", None), ("pre2", 24)])
def test_features_equal_the_sae_on_transformers_hidden_states(llm, reference, saes, name,
                                                              top_k, monkeypatch) -> None:
    """Every position each request ran through (the prompts chunked beside each other, their
    rows encoded together: one pass over the encoder a step): the top features equal the SAE's
    encoding of transformers' value at the site, top-k kept."""
    sae = saes[name]
    joined = answers_of(monkeypatch, "_results_together")
    outputs = _run(llm, [[ops.Features(sae=name, top_k=top_k)]] * len(PROMPTS))
    assert joined and all(joined)
    width = top_k or sae.k
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output.error is None, output.error
        assert set(output.saved) == {f"{name}.features.indices", f"{name}.features.values"}
        indices = output.saved[f"{name}.features.indices"]
        values = output.saved[f"{name}.features.values"]
        positions = len(prompt) + GENERATED - 1
        assert indices.shape == values.shape == (1, positions, width)
        assert indices.dtype == torch.long
        expected = sae.encode(site_values(reference, prompt + list(
            output.outputs[0].token_ids)[:-1], name))
        kept = expected.topk(width, dim=-1)
        expected_top = torch.zeros_like(expected).scatter(1, kept.indices, kept.values)
        got = dense(indices, values, sae.d_sae)
        assert (got - expected_top).abs().max() <= TOLERANCE
        assert bool((values[0, :, :-1] >= values[0, :, 1:]).all())  # largest first
        assert bool(((indices == -1) == (values == 0)).all())
        assert int((indices >= 0).sum()) > positions  # the check can fail: features are active


#: The Python of an environment holding SAELens (`nox -s tests` makes one: the noxfile's
#: `_oracle_pythons`).
SAELENS_PYTHON = os.environ.get("VLLM_INTERP_SAELENS_PYTHON")


@pytest.mark.skipif(not SAELENS_PYTHON, reason="needs VLLM_INTERP_SAELENS_PYTHON, the Python "
                    "of an environment with SAELens (nox -s tests makes one and sets it)")
def test_features_equal_saelens_itself_on_transformers_hidden_states(llm, reference, saes,
                                                                     sae_dirs, tmp_path) -> None:
    """The oracle we did not write: each suite SAE loaded by SAELens from the same folder and
    encoding transformers' value at its site (in SAELens's own environment) gives the features
    the engine saved, every active one (`top_k=None`)."""
    outputs = _run(llm, [[ops.Features(sae=name) for name in saes]] * len(PROMPTS))
    values = {}
    for index, (prompt, output) in enumerate(zip(PROMPTS, outputs, strict=True)):
        assert output.error is None, output.error
        tokens = prompt + list(output.outputs[0].token_ids)[:-1]
        for name in saes:
            values[f"{name}/{index}"] = site_values(reference, tokens, name).float().contiguous()
    request = {"values": str(tmp_path / "values.safetensors"), "saes": sae_dirs,
               "out": str(tmp_path / "encoded.safetensors")}
    save_file(values, request["values"])
    (tmp_path / "request.json").write_text(json.dumps(request))
    subprocess.run([SAELENS_PYTHON, str(Path(__file__).with_name("saelens_encode.py")),
                    str(tmp_path / "request.json")], check=True, timeout=600)
    theirs = load_file(request["out"])
    assert set(theirs) == set(values)
    for key, expected in theirs.items():
        name, index = key.split("/")
        saved = outputs[int(index)].saved
        got = dense(saved[f"{name}.features.indices"], saved[f"{name}.features.values"],
                    saes[name].d_sae)
        assert got.shape == expected.shape
        assert (got - expected).abs().max() <= TOLERANCE, key
        assert int((expected > 0).sum()) > expected.shape[0]  # features are active: can fail


def test_every_active_feature_without_top_k(llm, reference, saes) -> None:
    """`top_k=None` on SAEs with no bound on the features active at a token (JumpReLU,
    standard): every active feature at every position, as wide as the request's busiest
    position (each step's pieces padded to it), requests served one by one beside others
    reading a fixed top_k."""
    programs = [[ops.Features(sae="res1")], [ops.Features(sae="pre2")],
                [ops.Features(sae="res1", top_k=4)]]
    outputs = _run(llm, [programs[i % 3] for i in range(len(PROMPTS))])
    for index, (prompt, output) in enumerate(zip(PROMPTS, outputs, strict=True)):
        assert output.error is None, output.error
        name = "pre2" if index % 3 == 1 else "res1"
        indices = output.saved[f"{name}.features.indices"]
        values = output.saved[f"{name}.features.values"]
        expected = saes[name].encode(site_values(reference, prompt + list(
            output.outputs[0].token_ids)[:-1], name))
        if index % 3 == 2:
            assert indices.shape[2] == 4
            continue
        active = (expected != 0).sum(-1)
        assert indices.shape == values.shape == (1, len(prompt) + GENERATED - 1,
                                                 int(active.max()))
        assert int(active.min()) < int(active.max())  # the padding is checked: can fail
        assert ((indices[0] >= 0).sum(-1) == active).all()
        assert bool(((indices == -1) == (values == 0)).all())
        assert (dense(indices, values, saes[name].d_sae) - expected).abs().max() <= TOLERANCE


@torch.no_grad()
def hooked_greedy(reference, prompt: list[int], layer: int, edit) -> tuple[list[int],
                                                                           torch.Tensor]:
    """transformers' greedy tokens with `edit` applied to layer `layer`'s output, and that
    output (as edited) over the positions the request runs through."""
    edited: list[torch.Tensor] = []

    def hook(module, args, output):
        edited.append(edit(output[0] if isinstance(output, tuple) else output))
        return (edited[-1], *output[1:]) if isinstance(output, tuple) else edited[-1]

    handle = reference.model.layers[layer].register_forward_hook(hook)
    try:
        tokens = list(prompt)
        for _ in range(GENERATED):
            tokens.append(int(reference(torch.tensor([tokens])).logits[0, -1].argmax()))
        reference(torch.tensor([tokens[:-1]]))
    finally:
        handle.remove()
    return tokens[len(prompt):], edited[-1]


def test_features_at_each_prompts_last_token_are_encoded_together(llm, reference, saes,
                                                                  monkeypatch) -> None:
    """`positions=(-1,)` on every prompt: the rows kept are gathered and encoded once a step,
    and each request's one row equals the SAE's encoding of transformers' last prompt row."""
    joined = answers_of(monkeypatch, "_results_selected_together")
    outputs = _run(llm, [[ops.Features(sae="res1", top_k=5, positions=(-1,))]] * len(PROMPTS))
    assert joined and all(joined)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output.error is None, output.error
        expected = saes["res1"].encode(site_values(reference, prompt, "res1")[-1:]).topk(5)
        assert output.saved["res1.features.values"].shape == (1, 1, 5)
        assert torch.allclose(output.saved["res1.features.values"][0], expected.values,
                              atol=TOLERANCE)


def test_steer_features_equals_transformers_with_the_directions_added(llm, reference,
                                                                      saes) -> None:
    """The steered request generates what transformers does with `4 W_dec[3] - 2 W_dec[10]`
    added to layer 1's output; the requests beside it generate as without it."""
    sae = saes["res1"]
    direction = 4.0 * sae.W_dec[3] - 2.0 * sae.W_dec[10]
    steer = ops.SteerFeatures(sae="res1", features={3: 4.0, 10: -2.0})
    outputs = _run(llm, [[steer, ops.Save("layers.1.layer_output")], [], []])
    plain = _run(llm, None)
    expected_tokens, expected_hidden = hooked_greedy(reference, PROMPTS[0], 1,
                                                     lambda hidden: hidden + direction)
    assert outputs[0].error is None, outputs[0].error
    assert list(outputs[0].outputs[0].token_ids) == expected_tokens
    assert (outputs[0].saved["layers.1.layer_output"] - expected_hidden).abs().max() <= TOLERANCE
    assert expected_tokens != list(plain[0].outputs[0].token_ids)  # the check can fail
    for steered, alone in zip(outputs[1:], plain[1:], strict=True):
        assert list(steered.outputs[0].token_ids) == list(alone.outputs[0].token_ids)


def test_clamp_features_equals_the_sae_edit_made_by_hand(llm, reference, saes) -> None:
    """Clamping features 3 and 7 to 6.0 and 0.0 writes back `x + decode(f') - decode(f)` at
    layer 1's output: transformers with that edit by hand generates the same tokens, and the
    saved output is the edited one."""
    sae = saes["res1"]

    def clamped(hidden: torch.Tensor) -> torch.Tensor:
        features = sae.encode(hidden)
        changed = features.clone()
        changed[..., 3], changed[..., 7] = 6.0, 0.0
        return hidden + sae.decode(changed) - sae.decode(features)

    clamp = ops.ClampFeatures(sae="res1", features={3: 6.0, 7: 0.0})
    (output, *_) = _run(llm, [[clamp, ops.Save("layers.1.layer_output")], [], []])
    expected_tokens, expected_hidden = hooked_greedy(reference, PROMPTS[0], 1, clamped)
    assert output.error is None, output.error
    assert list(output.outputs[0].token_ids) == expected_tokens
    assert (output.saved["layers.1.layer_output"] - expected_hidden).abs().max() <= TOLERANCE


@pytest.mark.parametrize(("name", "every_active"), [("res1", 512), ("mlp0", None)])
def test_clamping_to_the_encoded_value_changes_nothing(llm, saes, name, every_active) -> None:
    """A feature clamped, at one position, to the value the SAE gives it there (read by
    `Features`), and one inactive everywhere clamped to 0: the tokens and every later value are
    those of the request without the clamp."""
    prompt = PROMPTS[1]
    later = "layers.2.layer_output"
    (read,) = _run(llm, [[ops.Features(sae=name, top_k=every_active), ops.Save(later)]],
                   [prompt])
    indices, values = read.saved[f"{name}.features.indices"], read.saved[
        f"{name}.features.values"]
    feature, value = int(indices[0, 4, 0]), float(values[0, 4, 0])
    assert value > 0  # the check can fail: a feature active at position 4
    inactive = int(next(f for f in range(saes[name].d_sae) if not bool((indices == f).any())))
    (clamped,) = _run(llm, [[ops.ClampFeatures(sae=name, features={feature: value},
                                               positions=(4,)),
                             ops.ClampFeatures(sae=name, features={inactive: 0.0}),
                             ops.Save(later)]], [prompt])
    assert clamped.error is None, clamped.error
    assert list(clamped.outputs[0].token_ids) == list(read.outputs[0].token_ids)
    assert (clamped.saved[later] - read.saved[later]).abs().max() <= 1e-5


def test_bad_sae_input_fails_by_name_and_alone(llm) -> None:
    """An unknown SAE is refused before anything runs; a feature past the SAE's width or a
    top_k past it fail their own request, naming it, and the others run."""
    with pytest.raises(LocationError, match=r"no SAE named 'res9'.*res1"):
        _run(llm, [[ops.Features(sae="res9", top_k=4)]] * len(PROMPTS))
    with pytest.raises(LocationError, match=r"one Features per SAE"):
        _run(llm, [[ops.Features(sae="res1", top_k=4), ops.Features(sae="res1", top_k=2)]],
             [PROMPTS[0]])
    with pytest.raises(ValueError, match=r"feature 3 has value nan"):
        ops.SteerFeatures(sae="res1", features={3: float("nan")})
    with pytest.raises(ValueError, match=r"feature index -1"):
        ops.ClampFeatures(sae="res1", features={-1: 0.0})
    outputs = _run(llm, [[ops.SteerFeatures(sae="res1", features={512: 1.0})],
                         [ops.Features(sae="res1", top_k=513)],
                         [ops.Save("layers.0.layer_output")]])
    assert "features [512] are not among the SAE's 512" in outputs[0].error
    assert "the SAE has 512 features; choose top_k <= 512" in outputs[1].error
    assert outputs[2].error is None and outputs[2].saved["layers.0.layer_output"].shape[1] == 2 \
        + GENERATED


def test_sae_ops_travel_as_plain_data() -> None:
    for op in (ops.Features(sae="res1", top_k=3, positions=(-1,)),
               ops.SteerFeatures(sae="res1", features={3: 4.0}, steps="decode"),
               ops.ClampFeatures(sae="res1", features={1: 0.5, 2: 0.0}, tokens=(5,))):
        assert ops.op_from_data(op.to_data()) == op
        assert op.location == "sae:res1"
    with pytest.raises(ValueError, match="give the name an SAE was loaded under"):
        ops.Features(sae="")


def test_saes_load_into_a_running_engine(llm, tmp_path) -> None:
    """`llm.load_saes`: a new SAE serves at once; a name already taken, or an SAE of another
    width, is refused by name and the others load."""
    random_sae("standard", "blocks.0.hook_resid_post", seed=9).save(tmp_path / "later")
    random_sae("standard", "blocks.0.hook_resid_post", d_in=64).save(tmp_path / "narrow")
    with pytest.raises(SAEsRefused) as refused:
        llm.load_saes({"later0": tmp_path / "later", "res1": tmp_path / "later",
                       "narrow0": tmp_path / "narrow"})
    assert set(refused.value.refused) == {"res1", "narrow0"}
    assert "already loaded" in refused.value.refused["res1"]
    assert llm.saes["later0"]["location"] == "layers.0.layer_output"
    # Files that name no site (as Gemma Scope's params.npz): the site given beside the path.
    random_sae("standard", None, seed=10).save(tmp_path / "unnamed")
    llm.load_saes({"given0": (tmp_path / "unnamed", "model.layers.0.output")})
    assert llm.saes["given0"]["location"] == "layers.0.layer_output"
    with pytest.raises(SAEsRefused, match=r"its site \(not named in its files\)"):
        llm.load_saes({"unnamed": tmp_path / "unnamed"})
    assert llm.saes["res1"]["architecture"] == "jumprelu"  # unchanged
    (output,) = _run(llm, [[ops.Features(sae="later0", top_k=4)]], [PROMPTS[0]])
    assert output.error is None and output.saved["later0.features.values"].shape == (
        1, len(PROMPTS[0]) + GENERATED - 1, 4)


REFUSED_AT_START = """
import json, sys
from vllm_runner import LLM, SAEsRefused
try:
    LLM(sys.argv[1], dtype="float32", max_model_len=128, kv_cache_memory_bytes=64 << 20,
        gpu_memory_utilization=0.15, enforce_eager=True, saes=json.loads(sys.argv[2]))
except SAEsRefused as refused:
    print(json.dumps({"message": str(refused), "refused": refused.refused}))
"""


@pytest.mark.first_pass_only
def test_an_sae_the_model_cannot_serve_is_refused_at_start(model_dir, tmp_path) -> None:
    """A width not the model's and a site with no standard location: the engine refuses both
    by name at start-up, and shuts down (in a process of its own: an in-process engine shut
    down takes vLLM's process-wide parallel state with it); a path that does not exist is
    refused before any engine starts."""
    random_sae("standard", "blocks.1.hook_resid_post", d_in=64).save(tmp_path / "narrow")
    random_sae("standard", "blocks.1.hook_attn_scores").save(tmp_path / "odd")
    saes = {"narrow": str(tmp_path / "narrow"), "odd": str(tmp_path / "odd")}
    ran = subprocess.run([sys.executable, "-c", REFUSED_AT_START, model_dir, json.dumps(saes)],
                         env=engine_script_environment(), capture_output=True, text=True,
                         timeout=600)
    assert ran.returncode == 0, ran.stderr[-4000:]
    answer = json.loads(ran.stdout.strip().splitlines()[-1])
    assert set(answer["refused"]) == {"narrow", "odd"}
    assert "64 wide activations, but layers.1.layer_output is 128 wide" in answer["message"]
    assert "blocks.1.hook_attn_scores" in answer["refused"]["odd"]
    with pytest.raises(ValueError, match=r"saes\['gone'\].*does not exist"):
        LLM(model_dir, saes={"gone": tmp_path / "missing"})
