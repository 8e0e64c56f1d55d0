"""The server's own routes under `/v1/interp/`: named vectors, kept saves, and what the engine
serves and holds (the completions routes are in `server`)."""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse

from vllm_runner.ops.checks import non_finite
from vllm_runner.server.json_ops import (
    DTYPE_NAMES,
    InterventionInputError,
    interventions_schema,
    tensor_from_json,
    tensor_to_json,
)
from vllm_runner.server.state import ServerState
from vllm_runner.server.vector_registry import MAX_VECTOR_BYTES, VectorRegistry

router = APIRouter()
logger = logging.getLogger(__name__)


#: The most characters of an error message (and of its `param`) an answer carries: a message
#: that quotes the request (a location of ten million characters) must not send it back whole.
MESSAGE_LIMIT = 2000


def shortened(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """`text`, cut to `limit` characters with how many more it had."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit:,} more characters)"


def error_response(status: HTTPStatus, message: str, param: str | None = None) -> JSONResponse:
    """An error answer in vLLM's (and OpenAI's) form, `param` naming the bad field."""
    error = ErrorResponse(error=ErrorInfo(
        message=shortened(message), type=status.phrase.replace(" ", ""),
        param=None if param is None else shortened(param), code=status.value))
    return JSONResponse(content=error.model_dump(), status_code=status.value)


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
    return JSONResponse(content={**answer, "kept_bytes": state.kept.held_bytes})


def _unwritable(error: OSError, outcome: str) -> JSONResponse:
    """A 507 for a vectors folder the server cannot write (full, read-only, gone): the client
    learns why and that nothing changed; the operator's log has the folder and the error."""
    logger.warning("vllm-interp: the vectors folder could not be written: %s", error)
    return error_response(HTTPStatus.INSUFFICIENT_STORAGE,
                          f"the server could not write its vectors folder "
                          f"({error.strerror or type(error).__name__}): {outcome}; ask its "
                          "operator (--interp-vectors)", "name")


def _registry(raw_request: Request, name: str) -> tuple[VectorRegistry, JSONResponse | None]:
    state: ServerState = raw_request.app.state.interp
    problem = state.vectors.check_name(name)
    return state.vectors, (None if problem is None
                           else error_response(HTTPStatus.BAD_REQUEST, problem, "name"))


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
        return error_response(HTTPStatus.BAD_REQUEST, str(error), error.field)
    except ValueError as error:
        return error_response(HTTPStatus.BAD_REQUEST, f"the body is not JSON: {error}", "body")
    if tensor.numel() * tensor.element_size() > MAX_VECTOR_BYTES:
        return error_response(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                              f"{tensor.numel()} values: a vector holds at most "
                              f"{MAX_VECTOR_BYTES} bytes", "body")
    if tensor.is_floating_point() and non_finite(tensor, on_logits=False):
        return error_response(HTTPStatus.BAD_REQUEST, "the vector holds NaN or infinity", "body")
    try:
        vectors.put(name, tensor)
    except OSError as error:
        return _unwritable(error, f"{name!r} was not registered")
    return JSONResponse(content={"name": name, "dtype": DTYPE_NAMES[tensor.dtype],
                                 "shape": list(tensor.shape)})


@router.get("/v1/interp/vectors/{name}")
async def get_vector(name: str, raw_request: Request) -> Any:
    """A registered vector, as `{"base64", "dtype", "shape"}` (the form its PUT takes)."""
    vectors, refused = _registry(raw_request, name)
    found = None if refused is not None else vectors.get(name)
    if found is None:
        return refused or error_response(HTTPStatus.NOT_FOUND,
                                         f"no vector is registered as {name!r}", "name")
    return JSONResponse(content=tensor_to_json(found))


@router.delete("/v1/interp/vectors/{name}")
async def delete_vector(name: str, raw_request: Request) -> Any:
    """Forget a registered vector (requests already queued keep their copy)."""
    vectors, refused = _registry(raw_request, name)
    if refused is not None:
        return refused
    try:
        deleted = vectors.delete(name)
    except OSError as error:
        return _unwritable(error, f"{name!r} is still registered")
    if not deleted:
        return error_response(HTTPStatus.NOT_FOUND, f"no vector is registered as {name!r}", "name")
    return JSONResponse(content={"deleted": name})


@router.get("/v1/interp/vectors")
async def list_vectors(raw_request: Request) -> Any:
    """The registered vectors' names."""
    state: ServerState = raw_request.app.state.interp
    return JSONResponse(content={"vectors": state.vectors.names()})


@router.get("/v1/interp/saves/{saves_id}")
async def get_saves(saves_id: str, raw_request: Request) -> Any:
    """Saves kept under `saves_id`, as one safetensors file (tensors named by location),
    streamed; forgotten once sent."""
    state: ServerState = raw_request.app.state.interp
    data = state.kept.take(saves_id)
    if data is None:
        return error_response(HTTPStatus.NOT_FOUND, f"no saves are kept as {saves_id!r} (they "
                              "are deleted when read, and after --interp-saves-ttl-s)",
                              "saves_id")
    chunk = 1 << 20
    return StreamingResponse((data[start:start + chunk] for start in range(0, len(data), chunk)),
                             media_type="application/octet-stream",
                             headers={"Content-Length": str(len(data))})


@router.delete("/v1/interp/saves/{saves_id}")
async def delete_saves(saves_id: str, raw_request: Request) -> Any:
    """Forget kept saves without fetching them."""
    state: ServerState = raw_request.app.state.interp
    if not state.kept.delete(saves_id):
        return error_response(HTTPStatus.NOT_FOUND, f"no saves are kept as {saves_id!r}",
                              "saves_id")
    return JSONResponse(content={"deleted": saves_id})


@router.get("/v1/interp/schema")
async def schema(raw_request: Request) -> Any:
    """The JSON Schema of `interventions` this server accepts (`json_ops.interventions_schema`,
    with `call` only when the operator allows it)."""
    state: ServerState = raw_request.app.state.interp
    return JSONResponse(content=interventions_schema(state.settings.allow_code))


@router.get("/v1/interp/default")
async def default_program(raw_request: Request) -> Any:
    """The program requests without `interventions` run (`--interp-default`), or null."""
    state: ServerState = raw_request.app.state.interp
    return JSONResponse(content={"interventions": state.settings.default})
