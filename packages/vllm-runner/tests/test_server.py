"""`vllm-interp serve` against the offline `LLM` on the same weights: a real server process on
127.0.0.1, driven with the `openai` client (`extra_body`) and plain HTTP."""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from conftest import (
    LARGE_PROMPT,
    LARGE_SAVES,
    LOGPROB_TOLERANCE,
    SUITE_COMPILED,
    SUITE_TAPS,
    same_values,
    serving,
    suite_numerics,
)
from openai import APIStatusError, BadRequestError, OpenAI
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_runner import ops
from vllm_runner.server.json_ops import tensor_from_json, tensor_to_json

PROMPT = [5, 17, 99, 3, 42, 8, 61]
TOKENS = 4
STEER = torch.randn(128, generator=torch.Generator().manual_seed(3))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def running_server(model_dir: str, folder: Path, *options: str, bare: bool = False,
                   environment: dict[str, str] | None = None) -> Iterator[str]:
    """`vllm-interp serve` as a user starts it (the installed command, the user's environment
    with the suite's numerics, so its values compare with the suite's engine), until the block
    ends; yields its base URL. `bare`: vLLM's own `serve` with the same
    settings, eager as ours, and neither our worker nor our routes (the oracle)."""
    port = _free_port()
    start = ([sys.executable, "-m", "vllm_runner.server.main"] if bare else
             [str(Path(sys.executable).parent / "vllm-interp")])
    command = [*start, "serve", model_dir,
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
               "--max-model-len", "128", "--max-num-seqs", "8", "--seed", "0",
               "--kv-cache-memory-bytes", str(64 << 20), "--served-model-name", "tiny",
               # A small share of a GPU, beside the suite's own engine (no effect on a CPU).
               "--gpu-memory-utilization", "0.15",
               # Compiled or eager as the suite's engine is (`SUITE_COMPILED`), both servers;
               # eager spelled out (the default only on a CPU), compiled as vLLM's default.
               *(["--no-enforce-eager", "--interp-taps", ",".join(SUITE_TAPS["taps"]),
                  "--interp-graph-taps", ",".join(SUITE_TAPS["graph_taps"])]
                 if SUITE_COMPILED and not bare else []),
               *(["--enforce-eager"] if not SUITE_COMPILED else []), *options]
    with serving(command, f"http://127.0.0.1:{port}", folder / f"server-{port}.log",
                 environment={**suite_numerics(), **(environment or {})}) as base:
        yield base


def test_a_tap_that_names_nothing_stops_the_server_by_name(model_dir: str,
                                                           tmp_path: Path) -> None:
    """As `LLM(taps=...)` refuses it: the model has three layers, so no layer 9 to tap."""
    with pytest.raises(AssertionError, match="the server exited") as stopped, running_server(
            model_dir, tmp_path, "--interp-taps", "layers.9.layer_output,layers.*.mlp_neurons"):
        pass
    assert "tap 'layers.9.layer_output'" in str(stopped.value), str(stopped.value)
    assert "tap 'layers.*.mlp_neurons'" not in str(stopped.value)


@pytest.fixture(scope="module")
def vectors(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vectors")


@pytest.fixture(scope="module")
def server(model_dir: str, vectors: Path, tmp_path_factory: pytest.TempPathFactory, sae_dirs):
    with running_server(model_dir, tmp_path_factory.mktemp("server"), "--interp-vectors",
                        str(vectors), "--interp-max-locations", "8",
                        "--interp-saves-budget-mib", "0.1",
                        "--interp-max-saved-mib", "0.25",
                        *[option for name, path in sae_dirs.items()
                          for option in ("--interp-sae", f"{name}={path}")]) as base:
        yield base


@pytest.fixture(scope="module")
def client(server: str) -> OpenAI:
    return OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def _offline(llm, interventions: list, prompt: list[int] = PROMPT) -> Any:
    (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                             SamplingParams(max_tokens=TOKENS, temperature=0.0),
                             interventions=interventions, use_tqdm=False)
    return output


def _complete(client: OpenAI, interventions: list | None, prompt: list[int] = PROMPT,
              extra: dict[str, Any] | None = None, **options: Any) -> Any:
    body = {} if interventions is None else {"interventions": interventions}
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=TOKENS,
                                     temperature=0.0, extra_body={**body, **(extra or {}),
                                                                  "return_token_ids": True},
                                     **options)


def _saves(choice: Any) -> dict[str, torch.Tensor]:
    interp = choice.model_extra["interp"]
    assert interp["error"] is None, interp["error"]
    return {location: tensor_from_json(value, location, lambda name: None)
            for location, value in interp["saves"].items()}


def test_saves_over_http_equal_the_offline_saves_bit_for_bit(client, llm) -> None:
    response = _complete(client, [{"op": "save", "location": "layers.*.layer_output"},
                                  {"op": "save", "location": "logits"}])
    (choice,) = response.choices
    offline = _offline(llm, [ops.Save("layers.*.layer_output"), ops.Save("logits")])
    assert list(choice.model_extra["token_ids"]) == list(offline.outputs[0].token_ids)
    saves = _saves(choice)
    assert saves.keys() == offline.saved.keys()
    for location, tensor in offline.saved.items():
        assert saves[location].dtype == tensor.dtype
        assert same_values(saves[location], tensor), location


def test_steering_over_http_changes_the_completion_exactly_as_offline(client, llm) -> None:
    vector = tensor_to_json(STEER)
    steered = _complete(client, [{"op": "add", "location": "layers.1.layer_output",
                                  "vector": vector, "scale": 8.0}])
    offline = _offline(llm, [ops.Add("layers.1.layer_output", STEER, scale=8.0)])
    plain = _offline(llm, [])
    assert list(steered.choices[0].model_extra["token_ids"]) == \
        list(offline.outputs[0].token_ids)
    assert list(offline.outputs[0].token_ids) != list(plain.outputs[0].token_ids)
    as_list = _complete(client, [{"op": "add", "location": "layers.1.layer_output",
                                  "vector": STEER.tolist(), "scale": 8.0}])
    assert as_list.choices[0].model_extra["token_ids"] == \
        steered.choices[0].model_extra["token_ids"]


def test_sae_ops_over_http_equal_the_offline_ones(client, llm) -> None:
    """The server's SAEs (`--interp-sae NAME=PATH`) by name: features, a steer and a clamp as
    JSON give the offline engine's tokens and saves; an SAE the server has not is a 400 naming
    the field, and a feature past the SAE's width fails its own request."""
    response = _complete(client, [
        {"op": "features", "sae": "res1", "top_k": 6},
        {"op": "steer_features", "sae": "mlp0", "features": {"5": 3.0, "9": -1.5}},
        {"op": "clamp_features", "sae": "res1", "features": {"2": 0.0}, "positions": [-1]}])
    offline = _offline(llm, [ops.Features(sae="res1", top_k=6),
                             ops.SteerFeatures(sae="mlp0", features={5: 3.0, 9: -1.5}),
                             ops.ClampFeatures(sae="res1", features={2: 0.0}, positions=(-1,))])
    (choice,) = response.choices
    assert list(choice.model_extra["token_ids"]) == list(offline.outputs[0].token_ids)
    saves = _saves(choice)
    assert saves.keys() == offline.saved.keys() == {"res1.features.indices",
                                                    "res1.features.values"}
    # The encoding is torch's matmul in the worker's process, whose CPU threads (and so sums)
    # differ between the two engines: equal indices, values to float32's precision.
    assert torch.equal(saves["res1.features.indices"], offline.saved["res1.features.indices"])
    assert torch.allclose(saves["res1.features.values"], offline.saved["res1.features.values"],
                          rtol=1e-5, atol=1e-5)
    with pytest.raises(BadRequestError) as refused:
        _complete(client, [{"op": "features", "sae": "nope", "top_k": 2}])
    assert "interventions[0].sae" in str(refused.value) and "res1" in str(refused.value)
    failed = _complete(client, [{"op": "steer_features", "sae": "res1", "features": {"512": 1}}])
    assert "features [512] are not among the SAE's 512" in \
        failed.choices[0].model_extra["interp"]["error"]


def test_a_probe_over_http_returns_the_offline_scores(client, llm) -> None:
    """Issue [Q]: `Probe` is plain data, so the server takes it with no code allowed; its
    per-token scores come back on the choice equal to the offline engine's."""
    weight = torch.randn(2, 128, generator=torch.Generator().manual_seed(4))
    bias = torch.randn(2, generator=torch.Generator().manual_seed(5))
    response = _complete(client, [{"op": "probe", "location": "layers.1.layer_output",
                                   "weight": tensor_to_json(weight), "bias": bias.tolist(),
                                   "name": "sentiment"},
                                  {"op": "probe", "location": "layers.*.layer_output",
                                   "weight": weight[0].tolist(), "positions": [-1]}])
    offline = _offline(llm, [ops.Probe("layers.1.layer_output", weight, bias, name="sentiment"),
                             ops.Probe("layers.*.layer_output", weight[0], positions=(-1,))])
    saves = _saves(response.choices[0])
    assert saves.keys() == offline.saved.keys()
    assert saves["layers.1.layer_output.sentiment"].shape == (1, len(PROMPT) + TOKENS - 1, 2)
    for name, tensor in offline.saved.items():
        assert same_values(saves[name], tensor), name


def test_a_plain_request_is_served_as_vllm_serves_it(client, llm) -> None:
    response = _complete(client, None)
    assert "interp" not in (response.choices[0].model_extra or {})
    assert list(response.choices[0].model_extra["token_ids"]) == \
        list(_offline(llm, []).outputs[0].token_ids)


def test_chat_saves_equal_the_offline_chat(client, llm) -> None:
    messages = [{"role": "user", "content": "hi there"}]
    response = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=TOKENS, temperature=0.0,
        extra_body={"interventions": [{"op": "save", "location": "layers.0.attention_output"}]})
    (offline,) = llm.chat([messages], SamplingParams(max_tokens=TOKENS, temperature=0.0),
                          interventions=[ops.Save("layers.0.attention_output")],
                          use_tqdm=False)
    (choice,) = response.choices
    assert "token_ids" not in (choice.model_extra or {})  # not asked for: not sent
    saves = _saves(choice)
    assert saves.keys() == offline.saved.keys() and len(saves) == 1
    assert all(same_values(saves[name], offline.saved[name]) for name in saves)


def _streamed_saves(chunks: list[Any]) -> tuple[list[int], dict[str, torch.Tensor]]:
    """The generated token ids of a streamed completion and the saves of its last event."""
    tokens = [t for chunk in chunks for choice in chunk.choices
              for t in (choice.model_extra or {}).get("token_ids") or ()]
    (last,) = [choice for chunk in chunks for choice in chunk.choices
               if "interp" in (choice.model_extra or {})]
    assert chunks[-1].choices[0] is last  # the saves come with the stream's last event
    return tokens, _saves(last)


def test_a_streamed_completion_steers_from_the_first_token_and_ends_with_its_saves(
        client, llm) -> None:
    stream = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=TOKENS, temperature=0.0, stream=True,
        extra_body={"return_token_ids": True, "interventions": [
            {"op": "add", "location": "layers.1.layer_output", "vector": STEER.tolist(),
             "scale": 8.0},
            {"op": "save", "location": "layers.2.layer_output"}]})
    tokens, saves = _streamed_saves(list(stream))
    offline = _offline(llm, [ops.Add("layers.1.layer_output", STEER, scale=8.0),
                             ops.Save("layers.2.layer_output")])
    assert tokens == list(offline.outputs[0].token_ids)
    assert saves.keys() == offline.saved.keys()
    assert all(same_values(saves[name], offline.saved[name]) for name in saves)


def test_a_streamed_chat_ends_with_its_saves_and_no_token_ids_it_did_not_ask_for(
        client, llm) -> None:
    messages = [{"role": "user", "content": "stream it"}]
    chunks = list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=TOKENS, temperature=0.0, stream=True,
        extra_body={"interventions": [{"op": "save", "location": "layers.1.mlp_output"}]}))
    assert not any("token_ids" in (choice.model_extra or {}) for chunk in chunks
                   for choice in chunk.choices)
    (offline,) = llm.chat([messages], SamplingParams(max_tokens=TOKENS, temperature=0.0),
                          interventions=[ops.Save("layers.1.mlp_output")], use_tqdm=False)
    _, saves = _streamed_saves(chunks)
    assert saves.keys() == offline.saved.keys()
    assert all(same_values(saves[name], offline.saved[name]) for name in saves)


def test_concurrent_clients_each_get_their_own_rows(client, llm, model_dir: str,
                                                    tmp_path: Path) -> None:
    prompts = [[(11 * i + j) % 250 + 1 for j in range(5 + i)] for i in range(16)]
    programs = [[{"op": "save", "location": f"layers.{i % 3}.layer_output"}] if i % 4 else None
                for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(lambda args: _complete(client, *args, logprobs=2),
                                  zip(programs, prompts, strict=True)))
    plain = [index for index, program in enumerate(programs) if program is None]
    # The plain requests, which shared steps with the programmed ones, against a bare vLLM
    # server of the same model and settings: the same tokens and log-probabilities.
    with running_server(model_dir, tmp_path, bare=True) as bare_server:
        bare_client = OpenAI(base_url=f"{bare_server}/v1", api_key="unused", max_retries=0)
        with ThreadPoolExecutor(len(plain)) as pool:
            bare = dict(zip(plain, pool.map(lambda index: _complete(
                bare_client, None, prompts[index], logprobs=2), plain), strict=True))
    for index, (program, prompt, response) in enumerate(zip(programs, prompts, responses,
                                                            strict=True)):
        (choice,) = response.choices
        if program is None:
            (expected,) = bare[index].choices
            assert choice.model_extra["token_ids"] == expected.model_extra["token_ids"]
            assert choice.text == expected.text
            for ours, theirs in zip(choice.logprobs.top_logprobs,
                                    expected.logprobs.top_logprobs, strict=True):
                assert ours.keys() == theirs.keys()
                assert all(abs(ours[key] - theirs[key]) <= LOGPROB_TOLERANCE for key in ours)
            assert list(choice.model_extra["token_ids"]) == \
                list(_offline(llm, [], prompt).outputs[0].token_ids)
            continue
        offline = _offline(llm, [ops.Save(program[0]["location"])], prompt)
        saves = _saves(choice)
        assert saves.keys() == offline.saved.keys() and len(saves) == 1
        assert all(same_values(saves[name], offline.saved[name]) for name in saves)


@pytest.mark.parametrize(("interventions", "field"), [
    ([{"op": "save", "location": "layers.9.layer_output"}], "interventions[0].location"),
    ([{"op": "save", "location": "layers.0.mlp_neurons"}, {"op": "frobnicate",
                                                           "location": "logits"}],
     "interventions[1].op"),
    ([{"op": "add", "location": "layers.0.layer_output", "vector": [1.0, 2.0],
       "scale": 1e300}], "interventions[0]"),
    ([{"op": "add", "location": "layers.0.layer_output",
       "vector": {"base64": "AAAA", "dtype": "float32", "shape": [2]}}],
     "interventions[0].vector"),
    ([{"op": "add", "location": "layers.0.layer_output", "vector": {"name": "missing"}}],
     "interventions[0].vector"),
    ([{"op": "call", "location": "layers.0.layer_output", "fn": "x"}], "interventions[0].op"),
    ([{"op": "save", "location": "layers.0.layer_output", "positions": [500]}],
     "interventions[0]"),
    # Shapes the engine's values could never take (hidden 128, 256 neurons, 4 heads of 32),
    # refused before queueing from the shapes the server learned at start-up.
    ([{"op": "add", "location": "layers.1.layer_output", "vector": [0.5] * 5}],
     "interventions[0].vector"),
    ([{"op": "save", "location": "logits"},
      {"op": "add", "location": "layers.*.mlp_neurons", "vector": [0.5] * 128}],
     "interventions[1].vector"),
    ([{"op": "set", "location": "layers.0.attention_head_outputs", "value": [[0.0] * 32] * 3}],
     "interventions[0].value"),
    ([{"op": "project_out", "location": "layers.2.layer_output", "direction": [1.0] * 64}],
     "interventions[0].direction"),
    ({"op": "save"}, "interventions"),
    ([{"op": "save", "location": "layers.*.layer_output"},  # 3 + 3 + 3 > 8 allowed
      {"op": "save", "location": "layers.*.mlp_output"},
      {"op": "save", "location": "layers.*.layer_input"}], "interventions"),
])
def test_bad_interventions_are_a_400_naming_the_field_and_the_server_keeps_serving(
        client, llm, interventions: Any, field: str) -> None:
    with pytest.raises(BadRequestError) as refused:
        _complete(client, interventions)
    error = refused.value.body
    assert error["param"] == field, error
    assert field in error["message"]
    test_a_plain_request_is_served_as_vllm_serves_it(client, llm)


def test_saves_that_could_pass_the_per_request_limit_are_a_400_before_queueing(server,
                                                                             client) -> None:
    # Every layer's layer_output and mlp_neurons: 3 * (128 + 256) * 4 bytes a token. Over
    # 7 + 99 tokens that could be 0.47 MiB, over the 0.25 this server allows a request.
    heavy = [{"op": "save", "location": "layers.*.layer_output"},
             {"op": "save", "location": "layers.*.mlp_neurons"}]
    with pytest.raises(BadRequestError) as refused:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=100,
                                  extra_body={"interventions": heavy})
    error = refused.value.body
    assert error["param"] == "interventions" and "--interp-max-saved-mib" in error["message"]
    # The same values at two positions, or over a short completion, fit.
    at_two = [{**op, "positions": [0, -1]} for op in heavy]
    for interventions, tokens in ((at_two, 100), (heavy, 8)):
        response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=tokens,
                                             extra_body={"interventions": interventions})
        assert response.choices[0].model_extra["interp"]["error"] is None
    # A chat prompt is counted as vLLM renders it; without max_tokens, up to max_model_len.
    messages = [{"role": "user", "content": "hi there"}]
    with pytest.raises(BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=messages,
                                       extra_body={"interventions": heavy})
    assert refused.value.body["param"] == "interventions"
    response = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                              extra_body={"interventions": heavy})
    assert response.choices[0].model_extra["interp"]["error"] is None
    # What is computed from the rows counts too: every active feature of a JumpReLU SAE could
    # be all 512 of them (12 bytes each) at 106 rows, 0.62 MiB; a lens's 200 tokens at three
    # layers, 0.73 MiB. Six features a row fit.
    for wide in ({"op": "features", "sae": "res1"},
                 {"op": "lens", "location": "layers.*.layer_output", "top_k": 200}):
        with pytest.raises(BadRequestError) as refused:
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=100,
                                      extra_body={"interventions": [wide]})
        assert "--interp-max-saved-mib" in refused.value.body["message"], wide
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=100,
                                         extra_body={"interventions": [
                                             {"op": "features", "sae": "res1", "top_k": 6}]})
    assert response.choices[0].model_extra["interp"]["error"] is None
    assert _held(server) == {"requests": 0, "bytes": 0, "kept_bytes": 0}


@pytest.mark.parametrize(("several", "field"), [({"n": 2}, "n"),
                                              ({"use_beam_search": True}, "use_beam_search")])
def test_several_samples_or_beams_with_interventions_are_a_400(client, several: dict,
                                                               field: str) -> None:
    n = several.pop("n", 1)
    with pytest.raises(BadRequestError) as refused:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, n=n,
                                  extra_body={**several, "interventions": [
                                      {"op": "save", "location": "logits"}]})
    assert refused.value.body["param"] == field


def _post(server: str, body: bytes) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(f"{server}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as refused:
        return refused.code, json.load(refused)


def test_a_nan_in_a_vector_is_a_400_naming_it(server: str) -> None:
    # Python's json writes NaN as a bare `NaN`, as many clients do; the openai client refuses to.
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "interventions": [
        {"op": "add", "location": "layers.0.layer_output",
         "vector": [1.0, float("nan")] + [0.0] * 126}]}).encode()
    status, answer = _post(server, body)
    assert status == 400 and answer["error"]["param"] == "interventions[0]", answer
    assert "non-finite" in answer["error"]["message"] or "NaN" in answer["error"]["message"]


def _held(server: str) -> dict[str, int]:
    with urllib.request.urlopen(f"{server}/v1/interp/held", timeout=30) as answer:
        return json.load(answer)


def _until_nothing_is_held(server: str) -> dict[str, int]:
    deadline = time.monotonic() + 60
    while (held := _held(server))["requests"] and time.monotonic() < deadline:
        time.sleep(0.5)
    return held


@pytest.mark.parametrize(("route", "stream"), [("completions", True),
                                               ("completions", False), ("chat/completions", True),
                                               ("chat/completions", False)])
def test_a_client_that_goes_away_mid_request_leaves_nothing_held(server: str, client, llm,
                                                                 route: str,
                                                                 stream: bool) -> None:
    assert _until_nothing_is_held(server) == {"requests": 0, "bytes": 0, "kept_bytes": 0}
    host, port = server.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    # As many tokens as max_model_len (128) leaves after the prompt: the longest run there is.
    prompt = ({"prompt": PROMPT, "max_tokens": 120} if route == "completions" else
              {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 90})
    connection.request("POST", f"/v1/{route}", json.dumps({
        "model": "tiny", **prompt, "ignore_eos": True,
        "stream": stream, "interventions": [{"op": "save",
                                             "location": "layers.*.layer_output"}]}),
        {"Content-Type": "application/json"})
    if stream:
        response = connection.getresponse()
        assert response.status == 200
        assert response.readline().startswith(b"data: ")  # it is running
    else:
        deadline = time.monotonic() + 30
        while _held(server)["bytes"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)  # until its first step has saved something
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    assert _until_nothing_is_held(server) == {"requests": 0, "bytes": 0, "kept_bytes": 0}
    test_a_plain_request_is_served_as_vllm_serves_it(client, llm)


def test_malformed_json_is_a_400(server: str) -> None:
    request = urllib.request.Request(f"{server}/v1/completions", data=b'{"model": "tiny", ',
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 400


def test_plain_http_and_the_support_table(server: str) -> None:
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0,
                       "interventions": [{"op": "lens", "location": "layers.2.layer_output",
                                          "top_k": 3, "positions": [-1]}]}).encode()
    request = urllib.request.Request(f"{server}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        choice = json.load(answer)["choices"][0]
    assert "token_ids" not in choice
    saves = choice["interp"]["saves"]
    tokens = saves["layers.2.layer_output.lens_tokens"]
    assert tokens["shape"] == [1, 1, 3]
    assert len(base64.b64decode(tokens["base64"])) == 3 * 8  # int64 token ids
    with urllib.request.urlopen(f"{server}/v1/interp/support", timeout=30) as answer:
        support = json.load(answer)
    assert support["layers.0.layer_output"] is None


def _http(method: str, url: str, body: Any = None,
          key: str | None = None) -> tuple[int, dict[str, Any]]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as refused:
        return refused.code, json.load(refused)


def test_a_registered_vector_steers_by_name_like_the_vector_itself(server, client, llm) -> None:
    status, answer = _http("PUT", f"{server}/v1/interp/vectors/steer-1", tensor_to_json(STEER))
    assert (status, answer["shape"]) == (200, [128]), answer
    by_name = _complete(client, [{"op": "add", "location": "layers.1.layer_output",
                                  "vector": {"name": "steer-1"}, "scale": 8.0}])
    offline = _offline(llm, [ops.Add("layers.1.layer_output", STEER, scale=8.0)])
    assert list(by_name.choices[0].model_extra["token_ids"]) == \
        list(offline.outputs[0].token_ids)
    status, answer = _http("GET", f"{server}/v1/interp/vectors/steer-1")
    assert status == 200 and torch.equal(tensor_from_json(answer, "x", lambda _: None), STEER)
    assert _http("GET", f"{server}/v1/interp/vectors")[1] == {"vectors": ["steer-1"]}


@pytest.mark.parametrize(("name", "body", "status", "field"), [
    ("../escape", [1.0], 404, None),  # not a route: a name never reaches the disk as a path
    (".hidden", [1.0], 400, "name"),
    ("fine", [1.0, float("inf")], 400, "body"),
    ("fine", {"base64": "AA==", "dtype": "float32", "shape": [1]}, 400, "body"),
])
def test_bad_vectors_are_refused_by_name(server, name: str, body: Any, status: int,
                                         field: str | None) -> None:
    got, answer = _http("PUT", f"{server}/v1/interp/vectors/{name}", body)
    assert got == status, answer
    if field is not None:
        assert answer["error"]["param"] == field, answer
    assert "fine" not in _http("GET", f"{server}/v1/interp/vectors")[1]["vectors"]


@pytest.mark.first_pass_only  # the vector registry and the key do not change with compilation
def test_a_restarted_server_keeps_its_vectors_runs_its_default_program_and_checks_its_key(
        model_dir: str, vectors: Path, tmp_path: Path, server, llm) -> None:
    assert _http("PUT", f"{server}/v1/interp/vectors/kept", tensor_to_json(STEER))[0] == 200
    default = [{"op": "add", "location": "layers.1.layer_output", "vector": {"name": "kept"},
                "scale": 8.0}, {"op": "save", "location": "logits"}]
    program = tmp_path / "default.json"
    program.write_text(json.dumps(default))
    with running_server(model_dir, tmp_path, "--interp-vectors", str(vectors),
                        "--interp-default", str(program), "--api-key", "sesame") as again:
        for method, route, body in [("GET", "vectors/kept", None), ("GET", "default", None),
                                    ("GET", "held", None), ("GET", "support", None),
                                    ("PUT", "vectors/other", [1.0]),
                                    ("DELETE", "vectors/kept", None)]:
            assert _http(method, f"{again}/v1/interp/{route}", body)[0] == 401, route
            assert _http(method, f"{again}/v1/interp/{route}", body, key="wrong")[0] == 401
        status, answer = _http("GET", f"{again}/v1/interp/vectors/kept", key="sesame")
        assert status == 200 and torch.equal(tensor_from_json(answer, "x", lambda _: None),
                                             STEER)
        assert _http("GET", f"{again}/v1/interp/default", key="sesame")[1] == \
            {"interventions": default}
        names = _http("GET", f"{again}/v1/interp/vectors", key="sesame")[1]["vectors"]
        assert "kept" in names and "other" not in names  # nothing changed without the key
        fresh = OpenAI(base_url=f"{again}/v1", api_key="sesame", max_retries=0)
        (steered,) = _complete(fresh, None).choices  # no interventions: the default runs
        (own,) = _complete(fresh, [{"op": "save", "location": "logits"}]).choices
        (none,) = _complete(fresh, []).choices
        # ~1.3 MB of saves, which leave the engine core through shared memory when it runs
        # apart (as under this server), returned in the response.
        (large,) = _complete(fresh, [{"op": "save", "location": location}
                                     for location in LARGE_SAVES], LARGE_PROMPT,
                             extra={"interp_saves": "inline"}).choices
    offline = _offline(llm, [ops.Add("layers.1.layer_output", STEER, scale=8.0),
                             ops.Save("logits")])
    assert list(steered.model_extra["token_ids"]) == list(offline.outputs[0].token_ids)
    assert same_values(_saves(steered)["logits"], offline.saved["logits"])
    plain = list(_offline(llm, []).outputs[0].token_ids)
    assert list(own.model_extra["token_ids"]) == plain  # its own program replaced the default
    assert list(none.model_extra["token_ids"]) == plain and "interp" not in none.model_extra
    offline = _offline(llm, [ops.Save(location) for location in LARGE_SAVES], LARGE_PROMPT)
    assert list(large.model_extra["token_ids"]) == list(offline.outputs[0].token_ids)
    saves = _saves(large)
    assert saves.keys() == offline.saved.keys() and len(saves) == 9
    # The offline engine prefills 8 tokens a step, the server the whole prompt: the same values
    # to float32 rounding (the transport itself is exact: test_wire.py).
    for location, tensor in offline.saved.items():
        torch.testing.assert_close(saves[location], tensor, rtol=1e-4, atol=1e-5)


def test_saves_kept_under_an_id_are_fetched_once_as_safetensors_equal_to_offline(
        server, client, llm) -> None:
    response = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=TOKENS, temperature=0.0,
        extra_body={"interp_saves": "id", "interventions": [
            {"op": "save", "location": "layers.*.mlp_neurons"}]})
    interp = response.choices[0].model_extra["interp"]
    assert interp["saves"] is None and interp["error"] is None
    assert _held(server)["kept_bytes"] == interp["saves_bytes"] > 0
    with urllib.request.urlopen(f"{server}/v1/interp/saves/{interp['saves_id']}",
                                timeout=60) as answer:
        fetched = safetensors.torch.load(answer.read())
    offline = _offline(llm, [ops.Save("layers.*.mlp_neurons")])
    assert fetched.keys() == offline.saved.keys() and len(fetched) == 3
    assert all(same_values(fetched[name], offline.saved[name]) for name in fetched)
    assert _http("GET", f"{server}/v1/interp/saves/{interp['saves_id']}")[0] == 404
    assert _held(server)["kept_bytes"] == 0


def test_saves_over_the_servers_budget_are_a_507_before_queueing_or_an_error_not_kept(
        server, client) -> None:
    heavy = [{"op": "save", "location": "layers.*.layer_output"}]

    def complete(tokens: int, saves: str) -> Any:
        return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=tokens,
                                         temperature=0.0, extra_body={
                                             "interp_saves": saves, "ignore_eos": True,
                                             "interventions": heavy})

    # 7 + 99 tokens of every layer's layer_output could take 0.16 MiB, more than the 0.1 MiB
    # this server keeps for all requests: refused before queueing; inline, no budget applies.
    with pytest.raises(APIStatusError) as refused:
        complete(100, "id")
    error = refused.value.body
    assert refused.value.status_code == 507 and error["param"] == "interp_saves"
    assert "--interp-saves-budget-mib" in error["message"]
    inline = complete(100, "inline").choices[0].model_extra["interp"]
    assert inline["error"] is None and inline["saves_bytes"] > 0.1 * 2**20
    # Each of two requests fits alone (0.05 MiB), not both: the second's saves are not kept,
    # and its interp says why.
    first, second = (complete(30, "id").choices[0].model_extra["interp"] for _ in range(2))
    assert first["error"] is None and first["saves_id"] is not None
    assert second["saves_id"] is None and second["saves"] is None
    assert "budget" in second["error"] and "--interp-saves-budget-mib" in second["error"]
    assert _held(server) == {"requests": 0, "bytes": 0, "kept_bytes": first["saves_bytes"]}
    assert _http("DELETE", f"{server}/v1/interp/saves/{first['saves_id']}")[0] == 200
    assert _held(server) == {"requests": 0, "bytes": 0, "kept_bytes": 0}
    with pytest.raises(BadRequestError) as refused:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, extra_body={
            "interp_saves": "later", "interventions": [{"op": "save", "location": "logits"}]})
    assert refused.value.body["param"] == "interp_saves"


def test_a_full_budget_with_slow_readers_refuses_only_the_saves_that_do_not_fit(
        server, client, llm) -> None:
    """Twelve requests at once keep their saves under ids while nobody reads (0.1 MiB: room for
    a few); those that do not fit say so, and nothing else changes: every completion's tokens,
    every kept save (read slowly, one by one, while another twelve run), the plain requests
    beside them, and nothing held at the end."""
    assert _held(server) == {"requests": 0, "bytes": 0, "kept_bytes": 0}
    save = [{"op": "save", "location": "layers.*.layer_output"}]
    prompts = [[5 + index, *PROMPT[1:]] for index in range(12)]

    def kept(prompt: list[int]) -> tuple[list[int], Any]:
        choice = _complete(client, save, prompt, {"interp_saves": "id"}).choices[0]
        return prompt, choice

    def plain(prompt: list[int]) -> list[int]:
        return list(_complete(client, None, prompt).choices[0].model_extra["token_ids"])

    def checked(prompt: list[int], choice: Any) -> str | None:
        """The choice's tokens equal offline; its kept saves' id, or None if refused."""
        offline = _offline(llm, [ops.Save("layers.*.layer_output")], prompt)
        assert list(choice.model_extra["token_ids"]) == list(offline.outputs[0].token_ids)
        interp = choice.model_extra["interp"]
        if interp["saves_id"] is None:
            assert "budget" in interp["error"] and interp["saves"] is None, interp
            return None
        assert interp["error"] is None
        return str(interp["saves_id"])

    def read_slowly(ids: dict[str, list[int]]) -> None:
        for saves_id, prompt in ids.items():
            time.sleep(0.3)
            with urllib.request.urlopen(f"{server}/v1/interp/saves/{saves_id}",
                                        timeout=60) as answer:
                fetched = safetensors.torch.load(answer.read())
            offline = _offline(llm, [ops.Save("layers.*.layer_output")], prompt).saved
            assert fetched.keys() == offline.keys()
            assert all(same_values(fetched[name], offline[name]) for name in offline)

    with ThreadPoolExecutor(16) as pool:
        plains = [pool.submit(plain, prompt) for prompt in prompts[:4]]
        first = {saves_id: prompt for prompt, choice in pool.map(kept, prompts)
                 if (saves_id := checked(prompt, choice)) is not None}
        assert 1 <= len(first) < len(prompts), first  # some kept, some refused
        reading = pool.submit(read_slowly, first)
        second = [pool.submit(kept, prompt) for prompt in prompts]
        reading.result()
        later = {saves_id: prompt for prompt, choice in (done.result() for done in second)
                 if (saves_id := checked(prompt, choice)) is not None}
        read_slowly(later)
        for prompt, answer in zip(prompts, plains, strict=False):
            assert answer.result() == list(_offline(llm, [], prompt).outputs[0].token_ids)
    assert _held(server) == {"requests": 0, "bytes": 0, "kept_bytes": 0}


@pytest.mark.skipif(torch.cuda.device_count() == 1, reason="tensor parallelism needs two GPUs")
# A compiled TP=2 engine is checked offline (test_tensor_parallel.py); the server's TP plumbing
# does not change with compilation.
@pytest.mark.first_pass_only
def test_a_tensor_parallel_server_saves_and_steers_as_the_single_process_engine(
        model_dir: str, llm, tmp_path: Path) -> None:
    # Two ranks, each on one core (vLLM's CPU backend asks for the binding under tensor
    # parallelism); the single-process offline engine is the oracle.
    with running_server(model_dir, tmp_path, "--tensor-parallel-size", "2",
                        "--distributed-executor-backend", "mp",
                        environment={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        program = [{"op": "save", "location": "layers.*.attention_queries"},
                   {"op": "save", "location": "layers.2.mlp_neurons"},
                   {"op": "save", "location": "logits"}]
        saved = _complete(client, program)
        steer = {"op": "add", "location": "layers.1.layer_output",
                 "vector": STEER.tolist(), "scale": 8.0}
        steered = _complete(client, [steer])
        held = _held(base)
    offline = _offline(llm, [ops.Save("layers.*.attention_queries"),
                             ops.Save("layers.2.mlp_neurons"), ops.Save("logits")])
    (choice,) = saved.choices
    assert list(choice.model_extra["token_ids"]) == list(offline.outputs[0].token_ids)
    saves = _saves(choice)
    assert saves.keys() == offline.saved.keys() and len(saves) == 5
    for location, expected in offline.saved.items():  # whole values, gathered over the ranks
        scale = float(expected.abs().max())
        torch.testing.assert_close(saves[location], expected, rtol=0,
                                   atol=1e-4 * max(scale, 1e-6), msg=location)
    offline_steered = _offline(llm, [ops.Add("layers.1.layer_output", STEER, scale=8.0)])
    assert list(steered.choices[0].model_extra["token_ids"]) == \
        list(offline_steered.outputs[0].token_ids)
    assert list(steered.choices[0].model_extra["token_ids"]) != \
        list(_offline(llm, []).outputs[0].token_ids)
    assert held == {"requests": 0, "bytes": 0, "kept_bytes": 0}
