"""The server under malformed and hostile requests: every one is a 4xx naming its field, never a
500 and never a hang, and the requests beside them are served as before.

The fuzzing is schemathesis's, from the live server's own OpenAPI document: its `POST
/v1/completions` route, whose `interventions` field the document leaves open, described by
`docs/interventions.schema.json` (the ops as JSON), the other fields held to one plain request.
schemathesis draws bodies that fit the schema (ops that run, and ops the engine refuses for what
no schema says: unknown locations, vectors of the wrong width) and bodies that do not, with a
fixed seed (`derandomize`) and a fixed number of examples, while another thread keeps sending a
plain request and checks its tokens.
"""

from __future__ import annotations

import base64
import json
import re
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from test_server import PROMPT, running_server

SCHEMA = Path(__file__).resolve().parents[3] / "docs" / "interventions.schema.json"
KEY = "fuzz-key"
AUTHORIZED = {"Authorization": f"Bearer {KEY}"}
#: The fields of the fuzzed requests besides `interventions`: one short plain completion.
PLAIN = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
#: Locations the drawn ops may name besides any string (so that some ops run).
REAL_LOCATIONS = ["layers.0.layer_output", "layers.1.mlp_output", "layers.2.attention_output",
                  "layers.*.layer_output", "logits", "layers.1.attention_probabilities"]
EXAMPLES = 200  # per generation mode: ~10 s each here
#: No answer may take longer, nor be larger (a refusal must not echo a huge request back).
SLOWEST_S, LARGEST_ERROR = 20.0, 10_000


@pytest.fixture(scope="module")
def server(model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("fuzzed")
    with running_server(model_dir, folder, "--api-key", KEY, "--interp-vectors",
                        str(folder / "vectors"), "--interp-max-saved-mib", "1",
                        "--interp-saves-budget-mib", "1") as base:
        yield base


def send(method: str, url: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, bytes, float]:
    """(status, body, seconds) of one request, with the key unless `headers` says otherwise."""
    request = urllib.request.Request(url, data=body, method=method, headers={
        "Content-Type": "application/json", **(AUTHORIZED if headers is None else headers)})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, answer.read(), time.monotonic() - started
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read(), time.monotonic() - started


def completion(server: str, **fields: Any) -> tuple[int, dict[str, Any]]:
    status, body, took = send("POST", f"{server}/v1/completions",
                              json.dumps({**PLAIN, **fields}).encode())
    assert took < SLOWEST_S, (fields, took)
    return status, json.loads(body)


def fuzzing_document(live: dict[str, Any], interventions: dict[str, Any]) -> dict[str, Any]:
    """The live server's completions route as an OpenAPI document of its own: the request body
    narrowed to `PLAIN`'s fields and `interventions` (the schema file, its `$defs` moved into
    the document's components, each op's `location` also drawn from `REAL_LOCATIONS`)."""
    route = live["paths"]["/v1/completions"]["post"]
    reference = route["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    taken = live["components"]["schemas"][reference.rsplit("/", 1)[-1]]["properties"]
    assert "interventions" in taken  # the live server's request takes the field
    field = json.loads(json.dumps(interventions).replace('"#/$defs/',
                                                         '"#/components/schemas/interp_'))
    components = {f"interp_{name}": value for name, value in field.pop("$defs").items()}
    field.pop("$schema")
    for op in field["items"]["oneOf"]:
        if "location" in op["properties"]:
            op["properties"]["location"] = {"anyOf": [{"enum": REAL_LOCATIONS},
                                                      {"type": "string"}]}
    body = {"type": "object", "additionalProperties": False,
            "required": [*PLAIN, "interventions"],
            "properties": {**{name: {"const": value} for name, value in PLAIN.items()},
                           "interventions": field}}
    return {"openapi": live["openapi"], "info": live["info"], "components": {
        "schemas": components}, "paths": {"/v1/completions": {"post": {
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": body}}},
            "responses": {"200": {"description": "the completion"}}}}}}


class Beside(threading.Thread):
    """A plain request sent again and again while the fuzzing runs: each answer must be the
    tokens it had before (`failures` says otherwise)."""

    def __init__(self, server: str, expected: list[int]) -> None:
        super().__init__(daemon=True)
        self.server, self.expected = server, expected
        self.stop, self.sent = threading.Event(), 0
        self.failures: list[Any] = []

    def run(self) -> None:
        while not self.stop.is_set():
            status, answer = completion(self.server, max_tokens=4, return_token_ids=True)
            found = answer["choices"][0].get("token_ids") if status == 200 else answer
            if found != self.expected:
                self.failures.append(found)
            self.sent += 1


def held(server: str) -> dict[str, int]:
    deadline = time.monotonic() + 60
    while True:
        found = json.loads(send("GET", f"{server}/v1/interp/held")[1])
        if not found["requests"] or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                         ids=lambda mode: mode.value)
def test_fuzzed_interventions_are_a_4xx_naming_the_field_and_nothing_else_changes(
        server: str, mode: GenerationMode) -> None:
    status, answer = completion(server, max_tokens=4, return_token_ids=True)
    assert status == 200
    beside = Beside(server, answer["choices"][0]["token_ids"])
    live = json.loads(send("GET", f"{server}/openapi.json")[1])
    route = schemathesis.openapi.from_dict(fuzzing_document(
        live, json.loads(SCHEMA.read_text())))["/v1/completions"]["POST"]
    answers: dict[int, int] = {}

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=route.as_strategy(generation_mode=mode))
    def fuzzed(case: Any) -> None:
        body = case.body
        if isinstance(body, dict) and "interventions" in body:
            # Only the interventions malformed: the rest stays the plain request.
            case.body = body = {**PLAIN, "interventions": body["interventions"]}
        started = time.monotonic()
        response = case.call(base_url=server, headers=AUTHORIZED, timeout=60)
        sent = repr(body)[:500]
        assert time.monotonic() - started < SLOWEST_S, sent
        assert response.status_code < 500, (sent, response.text[:1000])
        answers[response.status_code] = answers.get(response.status_code, 0) + 1
        if response.status_code >= 400:
            assert len(response.content) < LARGEST_ERROR, (sent, response.text[:300])
            error = response.json().get("error")
            if isinstance(body, dict) and body.get("interventions") is not None:
                assert str(error["param"]).startswith("interventions"), (sent, error)
        else:
            choice = response.json()["choices"][0]
            assert "interp" in choice or body.get("interventions") in (None, [])

    beside.start()
    try:
        fuzzed()
    finally:
        beside.stop.set()
        beside.join(timeout=60)
    assert beside.sent > 0 and not beside.failures, beside.failures[:3]
    assert sum(answers.values()) >= EXAMPLES // 2 and answers.get(400)
    if mode is GenerationMode.POSITIVE:
        assert answers.get(200)  # the check could fail: some drawn ops ran
    assert held(server) == {"requests": 0, "bytes": 0, "kept_bytes": 0}


def _nested(depth: int) -> str:
    return "[" * depth + "0.5" + "]" * depth


@pytest.mark.parametrize(("interventions", "param"), [
    (f'[{{"op": "save", "location": "layers.0.layer_output", "positions": '
     f'{list(range(128, 1_000_128))}}}]', "interventions[0]"),
    (f'[{{"op": "save", "location": "layers.0.layer_output", "tokens": '
     f'{list(range(256, 1_000_256))}}}]', "interventions[0]"),
    (json.dumps([{"op": "save", "location": "x" * 10_000_000}]), "interventions[0].location"),
    (json.dumps([{"op": "save", "location": "layers.99999999999.layer_output"}]),
     "interventions[0].location"),
    (json.dumps([{"op": "save", "location": "layers.0.layer_output\u202e\U0001f600\u0000"}]),
     "interventions[0].location"),
    (json.dumps([{"op": "add", "location": "layers.0.layer_output",
                  "vector": [0.5] * 5_000_000}]), "interventions[0].vector"),
    (json.dumps([{"op": "add", "location": "layers.0.layer_output", "vector": {
        "base64": "", "dtype": "float32", "shape": [10**12, 10**12]}}]),
     "interventions[0].vector"),
    (json.dumps([{"op": "add", "location": "layers.0.layer_output",
                  "vector": {"name": "../../../etc/passwd"}}]), "interventions[0].vector"),
    (f'[{{"op": "add", "location": "layers.0.layer_output", "vector": {_nested(900)}}}]',
     "interventions[0].vector"),
    (json.dumps([{"op": "call", "location": "layers.0.layer_output",
                  "function": base64.b64encode(b"not a pickle").decode()}]),
     "interventions[0].op"),
    (json.dumps([{"op": "save", "location": "layers.0.layer_output"}] * 100_000),
     "interventions"),
])
def test_hostile_interventions_are_refused_quickly_and_briefly_by_name(
        server: str, interventions: str, param: str) -> None:
    body = f'{json.dumps(PLAIN)[:-1]}, "interventions": {interventions}}}'.encode()
    status, answer, took = send("POST", f"{server}/v1/completions", body)
    assert status == 400 and took < SLOWEST_S, (status, answer[:300], took)
    assert len(answer) < LARGEST_ERROR, answer[:300]
    assert json.loads(answer)["error"]["param"] == param, answer[:300]


def test_bodies_no_parser_takes_are_a_400(server: str) -> None:
    for body in (f'{json.dumps(PLAIN)[:-1]}, "interventions": {_nested(100_000)}}}'.encode(),
                 b'{"model": "tiny", "interventions": [', b"\xff\xfe not json"):
        status, answer, took = send("POST", f"{server}/v1/completions", body)
        assert status == 400 and took < SLOWEST_S and len(answer) < LARGEST_ERROR, answer[:300]


def test_vector_names_cannot_leave_their_folder(server: str, tmp_path: Path) -> None:
    vector = json.dumps([0.5] * 128).encode()
    for name in ("..%2F..%2Fescaped", "a%2Fb", "%2Ftmp%2Fescaped", ".hidden", "x" * 300):
        status, answer, _ = send("PUT", f"{server}/v1/interp/vectors/{name}", vector)
        assert status in (400, 404), (name, status, answer[:300])
    assert not list(Path("/tmp").glob("escaped*")) and not (tmp_path.parent / "escaped").exists()
    assert send("PUT", f"{server}/v1/interp/vectors/fine.name-1", vector)[0] == 200


def test_kept_saves_ids_are_random_and_guarded_by_the_key(server: str) -> None:
    """Saves kept under an id: 192 random bits each (32 URL-safe characters), so one client
    cannot find another's by trying ids; the route wants the key like the others."""
    ids = []
    for _ in range(2):
        status, answer = completion(server, interp_saves="id", interventions=[
            {"op": "save", "location": "layers.0.layer_output"}])
        assert status == 200, answer
        ids.append(answer["choices"][0]["interp"]["saves_id"])
    assert ids[0] != ids[1] and all(re.fullmatch(r"[A-Za-z0-9_-]{32}", i) for i in ids), ids
    guessed = ids[0][:-1] + ("A" if ids[0][-1] != "A" else "B")
    assert send("GET", f"{server}/v1/interp/saves/{guessed}")[0] == 404
    assert send("GET", f"{server}/v1/interp/saves/{ids[0]}", headers={})[0] == 401
    for saves_id in ids:
        assert send("GET", f"{server}/v1/interp/saves/{saves_id}")[0] == 200
        assert send("GET", f"{server}/v1/interp/saves/{saves_id}")[0] == 404  # read once
