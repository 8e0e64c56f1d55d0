"""vLLM's own OpenAI-compatible server with per-request interventions (issue [L]).

Installed through vLLM's plugin contracts, not a server of our own: the worker is
`vllm_runner.worker.InterpGPUWorker` (or the CPU one) through `--worker-cls`, and this module is
the `vllm.endpoint_plugins` entry point `vllm_interp` (vLLM loads endpoint plugins only when
`VLLM_PLUGINS` names them; `vllm-interp serve` sets both). It replaces `POST /v1/completions` and
`POST /v1/chat/completions` with the same handlers plus an `interventions` field
(`vllm_runner.json_ops`): a request without one is served exactly as vLLM serves it; a request
with one is checked before it is queued (a bad field is a 400 naming it, and nothing reaches
the engine), runs its program in the worker like `LLM.generate`, and each choice of the
response carries `interp: {"saves": {location: tensor}, "error": null | str}`.

Client code (`Call`) is refused over HTTP unless the operator starts the server with
`--interp-allow-code` (`server_settings`). Named vectors live in `vector_registry`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import PrivateAttr
from vllm import SamplingParams
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse
from vllm.entrypoints.serve.utils.api_utils import (
    load_aware_call,
    validate_json_request,
    with_cancellation,
)
from vllm.entrypoints.serve.utils.sse_keep_alive import with_sse_keep_alive

from vllm_runner import wire
from vllm_runner.json_ops import (
    InterventionInputError,
    ops_from_json,
    saves_to_json,
    tensor_from_json,
    tensor_to_json,
)
from vllm_runner.op_limits import check_op_fits
from vllm_runner.ops import Op
from vllm_runner.program import EXTRA_ARGS_KEY, encode, encode_ops, new_program_id, program_digest
from vllm_runner.server_settings import ServerSettings
from vllm_runner.vector_registry import MAX_VECTOR_BYTES, VectorRegistry

#: The plugin's name, as `VLLM_PLUGINS` must list it.
PLUGIN_NAME = "vllm_interp"


@dataclass
class Plan:
    """One request's program, encoded once; each engine request made from it (one per prompt)
    gets its own program id, in prompt order."""

    ops_data: list[dict[str, Any]]
    digest: str
    program_ids: list[str] = field(default_factory=list)

    def attach(self, params: SamplingParams) -> SamplingParams:
        """Give one engine request's sampling parameters a program of their own, and keep it
        off cached prompt blocks (the program must see every prompt row)."""
        program_id = new_program_id()
        params.extra_args = {**(params.extra_args or {}),
                             EXTRA_ARGS_KEY: encode(program_id, self.ops_data, self.digest)}
        params.skip_reading_prefix_cache = True
        self.program_ids.append(program_id)
        return params


class InterpCompletionRequest(CompletionRequest):
    """vLLM's completion request with `interventions`."""

    interventions: Any = None  # checked by json_ops, whose errors say what to send
    _interp: Plan | None = PrivateAttr(default=None)

    def to_sampling_params(self, *args: Any, **kwargs: Any) -> SamplingParams:
        """vLLM's, with this request's program attached (called once per prompt)."""
        params = super().to_sampling_params(*args, **kwargs)
        return params if self._interp is None else self._interp.attach(params)


class InterpChatCompletionRequest(ChatCompletionRequest):
    """vLLM's chat completion request with `interventions`."""

    interventions: Any = None  # checked by json_ops, whose errors say what to send
    _interp: Plan | None = PrivateAttr(default=None)

    def to_sampling_params(self, *args: Any, **kwargs: Any) -> SamplingParams:
        """vLLM's, with this request's program attached."""
        params = super().to_sampling_params(*args, **kwargs)
        return params if self._interp is None else self._interp.attach(params)


class ServerState:
    """What the routes share: the engine, the model's limits, the operator's settings, the
    vector registry, resolved locations."""

    def __init__(self, engine_client: Any, settings: ServerSettings) -> None:
        self.engine = engine_client
        self.settings = settings
        self.vectors = VectorRegistry(settings.vectors)
        model_config = engine_client.model_config
        self.vocab_size = int(model_config.get_vocab_size())
        self.max_model_len = int(model_config.max_model_len)
        # pattern -> (how many locations it names, or why it is refused)
        self._resolved: dict[str, int | str] = {}
        self._pending: set[asyncio.Task[None]] = set()

    async def plan(self, interventions: Any) -> Plan:
        """Check a request's interventions against the model and the operator's limits and
        encode them; raises `InterventionInputError` naming the first bad field."""
        ops = ops_from_json(interventions, self.vectors.get,
                            allow_code=self.settings.allow_code)
        await self._check(ops)
        data = encode_ops(ops)
        return Plan(data, program_digest(data))

    async def _check(self, ops: list[Op]) -> None:
        unknown = sorted({p for op in ops for p in op.patterns()} - set(self._resolved))
        if unknown:
            (answer, *_) = await self.engine.collective_rpc("interp_resolve", args=(unknown,))
            for pattern in unknown:
                refused = answer["errors"].get(pattern)
                self._resolved[pattern] = (refused if refused is not None
                                           else len(answer["resolved"][pattern]))
        locations = 0
        for index, op in enumerate(ops):
            for pattern in op.patterns():
                found = self._resolved[pattern]
                if isinstance(found, str):
                    raise InterventionInputError(f"interventions[{index}].location", found)
                locations += found
            try:
                check_op_fits(op, self.vocab_size, self.max_model_len)
            except ValueError as error:
                raise InterventionInputError(f"interventions[{index}]", str(error)) from None
        if locations > self.settings.max_locations:
            raise InterventionInputError("interventions", f"the ops act at {locations} locations; "
                                         f"this server allows {self.settings.max_locations} per "
                                         "request (its --interp-max-locations): send fewer, or "
                                         "split them over several requests")

    async def results(self, plan: Plan, prompt_lengths: dict[int, int],
                      generated: dict[int, int]) -> dict[int, dict[str, Any]]:
        """Each finished engine request's `interp` (saves and error), by choice index (with
        `n=1`, a choice's index is its prompt's), collected from the worker in one call."""
        finished = [{"program_id": program_id,
                     "computed": prompt_lengths.get(index, 0) + max(generated.get(index, 0) - 1,
                                                                    0),
                     "prompt_length": prompt_lengths.get(index, 0)}
                    for index, program_id in enumerate(plan.program_ids)]
        (data, *_) = await self.engine.collective_rpc("interp_collect", args=(finished, True))
        collected = wire.decode(data)
        return {index: {"saves": saves_to_json(collected.get(program_id, {}).get("saved", {})),
                        "error": collected.get(program_id, {}).get("error")}
                for index, program_id in enumerate(plan.program_ids)}

    async def collect(self, body: dict[str, Any], plan: Plan, keep_token_ids: bool) -> None:
        """Put each choice's saves and error on it (`choice["interp"]`) in a whole response."""
        counts = TokenCounts()
        counts.add(body, keep_token_ids)
        results = await self.results(plan, counts.prompt, counts.generated)
        for choice in body["choices"]:
            choice["interp"] = results[choice["index"]]

    async def stream(self, chunks: AsyncGenerator[str, None], raw_request: Request, plan: Plan,
                     keep_token_ids: bool) -> AsyncGenerator[str, None]:
        """vLLM's server-sent events of a streamed response, then one more event holding each
        choice's `interp`, just before `data: [DONE]`. Edits act from the first token."""
        counts = TokenCounts()
        finished = False
        try:
            async for chunk in chunks:
                if chunk.startswith("data: [DONE]"):
                    results = await self.results(plan, counts.prompt, counts.generated)
                    last = {key: counts.last.get(key) for key in ("id", "object", "created",
                                                                  "model")}
                    last["choices"] = [{"index": index, "interp": result}
                                       for index, result in results.items()]
                    finished = True
                    yield f"data: {json.dumps(last)}\n\n"
                    yield chunk
                elif chunk.startswith("data: "):
                    event = json.loads(chunk[len("data: "):])
                    counts.add(event, keep_token_ids)
                    yield f"data: {json.dumps(event)}\n\n"
                else:
                    yield chunk
        finally:
            if not finished:  # the client went away, or the engine failed mid-stream
                self.abandon(raw_request, plan)

    def abandon(self, raw_request: Request, plan: Plan) -> None:
        """After a request failed or its client went away: abort its engine requests, then free
        what they saved (in that order, so no later step saves for them)."""
        metadata = getattr(raw_request.state, "request_metadata", None)
        request_ids = ([f"{metadata.request_id}-{i}" for i in range(len(plan.program_ids))]
                       if metadata is not None else [])

        async def drop() -> None:
            if request_ids:
                await self.engine.abort(request_ids)
            await self.engine.collective_rpc("interp_drop", args=(list(plan.program_ids),))

        task = asyncio.get_running_loop().create_task(drop())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)


class TokenCounts:
    """Prompt and generated token counts per choice, read from a response or its streamed
    events (`return_token_ids` is on for requests with a program), which are then stripped of
    the token ids the client did not ask for."""

    def __init__(self) -> None:
        self.prompt: dict[int, int] = {}
        self.generated: dict[int, int] = {}
        self.last: dict[str, Any] = {}

    def add(self, body: dict[str, Any], keep_token_ids: bool) -> None:
        """Count one response or event (completions put the prompt's ids on each choice, chat
        at the top)."""
        shared_prompt = body.get("prompt_token_ids")
        for choice in body.get("choices") or ():
            index = int(choice.get("index", 0))
            prompt = choice.get("prompt_token_ids") or shared_prompt
            if prompt is not None:
                self.prompt[index] = len(prompt)
            self.generated[index] = self.generated.get(index, 0) + len(
                choice.get("token_ids") or ())
            if not keep_token_ids:
                choice.pop("token_ids", None)
                choice.pop("prompt_token_ids", None)
        if not keep_token_ids:
            body.pop("prompt_token_ids", None)
        self.last = body


def _error(status: HTTPStatus, message: str, param: str | None = None) -> JSONResponse:
    error = ErrorResponse(error=ErrorInfo(message=message, type=status.phrase.replace(" ", ""),
                                          param=param, code=status.value))
    return JSONResponse(content=error.model_dump(), status_code=status.value)


def _streamed(raw_request: Request, events: AsyncGenerator[str, None]) -> StreamingResponse:
    """Server-sent events as vLLM's own routes send them (with its keep-alive comments)."""
    args = getattr(raw_request.app.state, "args", None)
    keep_alive = float(getattr(args, "sse_keep_alive_interval", 0) or 0)
    return StreamingResponse(content=with_sse_keep_alive(events, keep_alive),
                             media_type="text/event-stream")


async def _serve(request: InterpCompletionRequest | InterpChatCompletionRequest,
                 raw_request: Request,
                 create: Callable[[Any, Request], Awaitable[Any]]) -> Any:
    """Serve one request as vLLM's own route does, with its program when it has one."""
    state: ServerState = raw_request.app.state.interp
    plan = None
    # A request's own interventions replace the server's default program (`[]`: none at all).
    interventions = (request.interventions if request.interventions is not None
                     else state.settings.default)
    if interventions:
        try:
            plan = await state.plan(interventions)
        except InterventionInputError as error:
            return _error(HTTPStatus.BAD_REQUEST, str(error), error.field)
        if (request.n or 1) > 1:
            return _error(HTTPStatus.BAD_REQUEST, f"n={request.n} with interventions: the "
                          "samples would share one program's saves; send the request n times",
                          "n")
        request._interp = plan
        given = request.cache_salt
        request.cache_salt = plan.digest if given is None else f"{given}/{plan.digest}"
    keep_token_ids = bool(request.return_token_ids)
    if plan is not None:
        request.return_token_ids = True  # the saves are trimmed to each choice's tokens
    try:
        generator = await create(request, raw_request)
        if isinstance(generator, ErrorResponse):
            if plan is not None:
                state.abandon(raw_request, plan)
            return JSONResponse(content=generator.model_dump(), status_code=generator.error.code)
        if plan is None:
            if hasattr(generator, "model_dump"):
                return JSONResponse(content=generator.model_dump())
            return _streamed(raw_request, generator)
        if hasattr(generator, "model_dump"):
            body = generator.model_dump()
            await state.collect(body, plan, keep_token_ids)
            return JSONResponse(content=body)
        return _streamed(raw_request, state.stream(generator, raw_request, plan,
                                                   keep_token_ids))
    except BaseException:
        if plan is not None:
            state.abandon(raw_request, plan)
        raise


router = APIRouter()
_ANSWERS: dict[int | str, dict[str, Any]] = {
    HTTPStatus.BAD_REQUEST.value: {"model": ErrorResponse}}


@router.post("/v1/completions", dependencies=[Depends(validate_json_request)],
             responses=_ANSWERS)
@with_cancellation
@load_aware_call
async def create_completion(request: InterpCompletionRequest, raw_request: Request) -> Any:
    """vLLM's `/v1/completions`, with `interventions`."""
    handler = raw_request.app.state.openai_serving_completion
    if handler is None:
        return _error(HTTPStatus.NOT_FOUND, "The model does not support Completions API")
    return await _serve(request, raw_request, handler.create_completion)


@router.post("/v1/chat/completions", dependencies=[Depends(validate_json_request)],
             responses=_ANSWERS)
@with_cancellation
@load_aware_call
async def create_chat_completion(request: InterpChatCompletionRequest,
                                 raw_request: Request) -> Any:
    """vLLM's `/v1/chat/completions`, with `interventions`."""
    handler = raw_request.app.state.openai_serving_chat
    if handler is None:
        return _error(HTTPStatus.NOT_FOUND, "The model does not support Chat Completions API")
    return await _serve(request, raw_request, handler.create_chat_completion)


@router.get("/v1/interp/support")
async def support(raw_request: Request) -> Any:
    """Every value of the served model → `null` if it can be read and edited, else why not (the
    same table as `LLM.support()`); also how a client checks the interventions are served."""
    state: ServerState = raw_request.app.state.interp
    (answer, *_) = await state.engine.collective_rpc("interp_support")
    return JSONResponse(content=answer)


@router.get("/v1/interp/held")
async def held(raw_request: Request) -> Any:
    """What the engine holds for requests not collected yet: `{"requests": n, "bytes": b}`
    (0 and 0 when nothing runs: saves are freed when their response is sent, or when a request
    ends early)."""
    state: ServerState = raw_request.app.state.interp
    (answer, *_) = await state.engine.collective_rpc("interp_held")
    return JSONResponse(content=answer)


def _registry(raw_request: Request, name: str) -> tuple[VectorRegistry, JSONResponse | None]:
    state: ServerState = raw_request.app.state.interp
    problem = state.vectors.check_name(name)
    return state.vectors, (None if problem is None
                           else _error(HTTPStatus.BAD_REQUEST, problem, "name"))


@router.put("/v1/interp/vectors/{name}")
async def put_vector(name: str, raw_request: Request) -> Any:
    """Register a vector under `name` (the body: a list of numbers, or `{"base64", "dtype",
    "shape"}`), kept on the server's disk; requests then send `{"name": name}`."""
    vectors, refused = _registry(raw_request, name)
    if refused is not None:
        return refused
    try:
        body = await raw_request.json()
        tensor = tensor_from_json(body, "body", lambda _: None)
    except InterventionInputError as error:
        return _error(HTTPStatus.BAD_REQUEST, str(error), error.field)
    except ValueError as error:
        return _error(HTTPStatus.BAD_REQUEST, f"the body is not JSON: {error}", "body")
    if tensor.numel() * tensor.element_size() > MAX_VECTOR_BYTES:
        return _error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"{tensor.numel()} values: a "
                      f"vector holds at most {MAX_VECTOR_BYTES} bytes", "body")
    if tensor.is_floating_point() and not bool(tensor.isfinite().all()):
        return _error(HTTPStatus.BAD_REQUEST, "the vector holds NaN or infinity", "body")
    vectors.put(name, tensor)
    return JSONResponse(content={"name": name, "dtype": tensor_to_json(tensor)["dtype"],
                                 "shape": list(tensor.shape)})


@router.get("/v1/interp/vectors/{name}")
async def get_vector(name: str, raw_request: Request) -> Any:
    """A registered vector, as `{"base64", "dtype", "shape"}` (the form its PUT takes)."""
    vectors, refused = _registry(raw_request, name)
    found = None if refused is not None else vectors.get(name)
    if found is None:
        return refused or _error(HTTPStatus.NOT_FOUND, f"no vector is registered as {name!r}",
                                 "name")
    return JSONResponse(content=tensor_to_json(found))


@router.delete("/v1/interp/vectors/{name}")
async def delete_vector(name: str, raw_request: Request) -> Any:
    """Forget a registered vector (requests already queued keep their copy)."""
    vectors, refused = _registry(raw_request, name)
    if refused is not None:
        return refused
    if not vectors.delete(name):
        return _error(HTTPStatus.NOT_FOUND, f"no vector is registered as {name!r}", "name")
    return JSONResponse(content={"deleted": name})


@router.get("/v1/interp/vectors")
async def list_vectors(raw_request: Request) -> Any:
    """The registered vectors' names."""
    state: ServerState = raw_request.app.state.interp
    return JSONResponse(content={"vectors": state.vectors.names()})


@router.get("/v1/interp/default")
async def default_program(raw_request: Request) -> Any:
    """The program requests without `interventions` run (`--interp-default`), or null."""
    state: ServerState = raw_request.app.state.interp
    return JSONResponse(content={"interventions": state.settings.default})


class InterpEndpoints:
    """The `vllm.endpoint_plugins` entry point: the routes above on vLLM's server."""

    name = PLUGIN_NAME
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        """Put the routes on vLLM's app (they replace vLLM's own for the same paths)."""
        app.include_router(router)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        """The routes' shared state, once the engine is up; refuses to start on an engine
        without the interpretability worker (its requests would silently run no programs)."""
        if engine_client is None:  # vLLM's render-only server: no engine, nothing to serve
            return
        try:
            await engine_client.collective_rpc("interp_support")
        except Exception as error:
            raise RuntimeError(
                "the vllm_interp endpoint plugin needs the interpretability worker: start the "
                "server with `vllm-interp serve MODEL`, or pass `--worker-cls "
                "vllm_runner.worker.InterpGPUWorker` (vllm_runner.cpu_worker.InterpCPUWorker on "
                f"a CPU) to `vllm serve` ({type(error).__name__}: {error})") from error
        interp = ServerState(engine_client, ServerSettings.from_environment())
        if interp.settings.default is not None:
            try:  # a default that no request could run stops the server now, not per request
                await interp.plan(interp.settings.default)
            except InterventionInputError as error:
                raise ValueError(f"--interp-default: {error}") from None
        state.interp = interp
