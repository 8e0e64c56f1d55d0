"""vLLM's own OpenAI-compatible server with per-request interventions (issue [L]).

Installed through vLLM's plugin contracts, not a server of our own: the worker is
`vllm_runner.engine.worker.InterpGPUWorker` (or the CPU one) through `--worker-cls`, and this module
is the `vllm.endpoint_plugins` entry point `vllm_interp` (vLLM loads endpoint plugins only when
`VLLM_PLUGINS` names them; `vllm-interp serve` sets both). It replaces `POST /v1/completions` and
`POST /v1/chat/completions` with the same handlers plus an `interventions` field
(`vllm_runner.server.json_ops`): a request without one is served exactly as vLLM serves it; a
request with one is checked before it is queued (a bad field is a 400 naming it, and nothing reaches
the engine), runs its program in the worker like `LLM.generate`, and each choice of the response
carries `interp: {"saves": {location: tensor}, "error": null | str}`.

Client code (`Call`) is refused over HTTP unless the operator starts the server with
`--interp-allow-code` (`server.settings`). The other routes (named vectors, kept saves, what the
engine serves and holds) are in `server.routes`; the request types in `server.requests`, what
the routes share in `server.state`.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from http import HTTPStatus
from typing import Any

import vllm
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.entrypoints.serve.utils.api_utils import (
    load_aware_call,
    validate_json_request,
    with_cancellation,
)
from vllm.entrypoints.serve.utils.sse_keep_alive import with_sse_keep_alive

from vllm_runner.engine.compat import check_version
from vllm_runner.errors import LocationError, SAEsRefused
from vllm_runner.server import routes as server_routes
from vllm_runner.server.json_ops import InterventionInputError
from vllm_runner.server.requests import InterpChatCompletionRequest, InterpCompletionRequest
from vllm_runner.server.routes import error_response
from vllm_runner.server.settings import ServerSettings
from vllm_runner.server.state import ServerState
from vllm_runner.settings import refused_saes_message, refused_taps_message

#: The plugin's name, as `VLLM_PLUGINS` must list it.
PLUGIN_NAME = "vllm_interp"


def _streamed(raw_request: Request, events: AsyncGenerator[str, None]) -> StreamingResponse:
    """Server-sent events as vLLM's own routes send them (with its keep-alive comments)."""
    args = getattr(raw_request.app.state, "args", None)
    keep_alive = float(getattr(args, "sse_keep_alive_interval", 0) or 0)
    return StreamingResponse(content=with_sse_keep_alive(events, keep_alive),
                             media_type="text/event-stream")


#: A route's prompt lengths for a request, as vLLM renders its prompts (`None`: vLLM refuses
#: them, and its own handler will say why).
PromptLengths = Callable[[Any], Awaitable["list[int] | None"]]


def _lengths(engine_inputs: list[Any]) -> list[int] | None:
    """Each rendered prompt's token count; `None` where one has no token ids to count."""
    lengths = []
    for engine_input in engine_inputs:
        ids = engine_input.get("prompt_token_ids") if isinstance(engine_input, dict) else None
        if ids is None:
            return None
        lengths.append(len(ids))
    return lengths


async def _serve(request: InterpCompletionRequest | InterpChatCompletionRequest,
                 raw_request: Request,
                 create: Callable[[Any, Request], Awaitable[Any]],
                 prompt_lengths: PromptLengths) -> Any:
    """Serve one request as vLLM's own route does, with its program when it has one."""
    state: ServerState = raw_request.app.state.interp
    plan = None
    # A request's own interventions replace the server's default program (`[]`: none at all;
    # any other value that is not a list of ops is refused by `state.plan`, naming the field).
    interventions = (request.interventions if request.interventions is not None
                     else state.settings.default)
    if interventions is not None and interventions != []:
        # The request's own fields first: they cost nothing to check, the program an RPC.
        if request.interp_saves not in ("auto", "inline", "id"):
            return error_response(HTTPStatus.BAD_REQUEST,
                                  f"interp_saves={request.interp_saves!r}: \"inline\" (in the "
                                  "response), \"id\" (kept for GET /v1/interp/saves/{id}) or "
                                  "\"auto\" (by size)", "interp_saves")
        if getattr(request, "use_beam_search", False):
            return error_response(HTTPStatus.BAD_REQUEST, "use_beam_search with interventions: "
                                  "the beams would share one program's saves; send them without "
                                  "beam search", "use_beam_search")
        if (request.n or 1) > 1:
            return error_response(HTTPStatus.BAD_REQUEST, f"n={request.n} with interventions: "
                                  "the samples would share one program's saves; send the "
                                  "request n times", "n")
        try:
            plan = await state.plan(interventions)
            plan.saves = request.interp_saves
            if any(op.keeps_rows for op in plan.ops):
                lengths = await prompt_lengths(request)
                if lengths is not None:
                    state.check_saved_bytes(plan, lengths, _max_tokens(request))
        except InterventionInputError as error:
            return error_response(error.status, str(error), error.field)
        request._interp = plan
        request.cache_salt = plan.salt(request.cache_salt)
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


def _max_tokens(request: InterpCompletionRequest | InterpChatCompletionRequest) -> int | None:
    """The most tokens the request asks for, if it says (chat's newer field first)."""
    asked = getattr(request, "max_completion_tokens", None) or request.max_tokens
    return None if asked is None else int(asked)


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
        return error_response(HTTPStatus.NOT_FOUND, "The model does not support Completions API")
    async def prompt_lengths(request: Any) -> list[int] | None:
        rendered = await handler.render_completion_request(request)
        return None if isinstance(rendered, ErrorResponse) else _lengths(rendered)

    return await _serve(request, raw_request, handler.create_completion, prompt_lengths)


@router.post("/v1/chat/completions", dependencies=[Depends(validate_json_request)],
             responses=_ANSWERS)
@with_cancellation
@load_aware_call
async def create_chat_completion(request: InterpChatCompletionRequest,
                                 raw_request: Request) -> Any:
    """vLLM's `/v1/chat/completions`, with `interventions`."""
    handler = raw_request.app.state.openai_serving_chat
    if handler is None:
        return error_response(HTTPStatus.NOT_FOUND,
                              "The model does not support Chat Completions API")
    async def prompt_lengths(request: Any) -> list[int] | None:
        rendered = await handler.render_chat_request(request)
        return None if isinstance(rendered, ErrorResponse) else _lengths(rendered[1])

    return await _serve(request, raw_request, handler.create_chat_completion, prompt_lengths)


class InterpEndpoints:
    """The `vllm.endpoint_plugins` entry point: the routes above on vLLM's server."""

    name = PLUGIN_NAME
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        """Put the routes on vLLM's app (they replace vLLM's own for the same paths)."""
        app.include_router(router)
        app.include_router(server_routes.router)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        """The routes' shared state, once the engine is up; refuses to start on an engine
        without the interpretability worker (its requests would silently run no programs), or
        whose workers refused a tap (`--interp-taps`: a pattern that names nothing, a value
        the model never serves), naming it as `LLM(taps=...)` does."""
        check_version(vllm.__version__)  # `vllm serve` with our plugin, not through ours
        if engine_client is None:  # vLLM's render-only server: no engine, nothing to serve
            return
        try:
            await engine_client.collective_rpc("interp_support")
        except Exception as error:
            raise RuntimeError(
                "the vllm_interp endpoint plugin needs the interpretability worker: start the "
                "server with `vllm-interp serve MODEL`, or pass `--worker-cls "
                "vllm_runner.engine.worker.InterpGPUWorker` "
                "(vllm_runner.engine.cpu_worker.InterpCPUWorker on "
                f"a CPU) to `vllm serve` ({type(error).__name__}: {error})") from error
        (taps, *_) = await engine_client.collective_rpc("interp_taps")
        if taps["refused"]:  # as `LLM` refuses them: a tap that can never serve stops the start
            raise LocationError(f"--interp-taps / --interp-graph-taps: "
                                f"{refused_taps_message(taps['refused'])}")
        (saes, *_) = await engine_client.collective_rpc("interp_saes")
        if saes["refused"]:  # as `LLM` refuses them
            raise SAEsRefused(f"--interp-sae: {refused_saes_message(saes['refused'])}",
                              saes["refused"])
        interp = ServerState(engine_client, ServerSettings.from_environment(), saes["loaded"])
        await interp.learn_shapes()
        if interp.settings.default is not None:
            try:  # a default that no request could run stops the server now, not per request
                await interp.plan(interp.settings.default)
            except InterventionInputError as error:
                raise ValueError(f"--interp-default: {error}") from None
        state.interp = interp
