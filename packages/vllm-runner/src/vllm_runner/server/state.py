"""What the server's routes share (`ServerState`): the engine, the operator's settings, the vector
registry and kept saves; checking a request's interventions before it is queued, collecting its
saves from the worker when it ends, and freeing them when its client goes away."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from http import HTTPStatus
from typing import Any

from fastapi import Request
from vllm import SamplingParams
from vllm.engine.protocol import EngineClient

from vllm_runner.client.collection import collect_async
from vllm_runner.ops import Op, Save
from vllm_runner.ops.limits import check_op_fits
from vllm_runner.ops.locations import unservable
from vllm_runner.server.json_ops import InterventionInputError, ops_from_json, saves_to_json
from vllm_runner.server.kept_saves import KeptSaves, KeptSavesFull
from vllm_runner.server.requests import Plan
from vllm_runner.server.settings import ServerSettings
from vllm_runner.server.value_shapes import (
    ValueShape,
    check_tensors_fit,
    saved_bytes_bound,
    shapes_from_saves,
)
from vllm_runner.server.vector_registry import VectorRegistry


class SavesOverBudget(InterventionInputError):
    """A request's saves could not be kept within the server's budget for kept saves: a 507
    (Insufficient Storage), before anything is queued."""

    status = HTTPStatus.INSUFFICIENT_STORAGE


class ServerState:
    """What the routes share: the engine, the model's limits, the operator's settings, the
    vector registry, resolved locations."""

    def __init__(self, engine_client: EngineClient, settings: ServerSettings,
                 saes: dict[str, dict[str, Any]] | None = None) -> None:
        self.engine = engine_client
        self.settings = settings
        #: The engine's SAEs as `LLM.saes` describes them (what their features take).
        self.saes = saes or {}
        self.vectors = VectorRegistry(settings.vectors)
        self.kept = KeptSaves(settings.saves_budget_bytes, settings.saves_ttl_s)
        model_config = engine_client.model_config
        self.vocab_size = int(model_config.get_vocab_size())
        self.max_model_len = int(model_config.max_model_len)
        # pattern -> (the locations it names, or why it is refused)
        self._resolved: dict[str, list[str] | str] = {}
        #: Locations no edit can be served at, with the reason (from `interp_resolve`).
        self._edit_refusals: dict[str, str] = {}
        # location -> its shape at one token (`learn_shapes`; empty: nothing checked before
        # queueing, the worker still checks every step)
        self.shapes: dict[str, ValueShape] = {}
        self._pending: set[asyncio.Task[None]] = set()

    async def learn_shapes(self) -> None:
        """Learn every value's shape from the engine: one request of one token that saves
        every value (what `plan` checks tensors and bounds saves with)."""
        (layouts, *_) = await self.engine.collective_rpc("interp_layouts")
        ops: list[Op] = [Save(location) for location in layouts]
        plan = Plan.of(ops)
        params = SamplingParams(max_tokens=1, temperature=0.0)
        plan.attach(params)
        async for _ in self.engine.generate({"prompt_token_ids": [0]}, params,
                                            f"interp-shapes-{plan.program_ids[0]}"):
            pass
        (collected,) = await self._collect(plan, {0: 1}, {0: 1})
        if collected.get("error"):
            raise RuntimeError(f"the engine could not save its values: {collected['error']}")
        self.shapes = shapes_from_saves(layouts, collected.get("saved", {}))

    async def plan(self, interventions: Any) -> Plan:
        """Check a request's interventions against the model and the operator's limits and
        encode them; raises `InterventionInputError` naming the first bad field."""
        ops = ops_from_json(interventions, self.vectors.get,
                            allow_code=self.settings.allow_code)
        locations = await self._check(ops)
        return Plan.of(ops, locations=locations)

    def check_saved_bytes(self, plan: Plan, prompt_lengths: list[int],
                          max_tokens: int | None) -> None:
        """Refuse a request whose saves could take more than the operator allows, for its
        prompts as vLLM rendered them: over the per-request limit a 400
        (`InterventionInputError`), over all that the server keeps a 507 (`SavesOverBudget`) where
        the saves would be kept under an id rather than returned."""
        bounds, generated = [], []
        for prompt_length in prompt_lengths:
            most = self.max_model_len - prompt_length
            generated.append(most if max_tokens is None else min(max_tokens, most))
            bounds.append(saved_bytes_bound(plan.ops, plan.locations, self.shapes,
                                            prompt_length, generated[-1], self.saes))
        prompts = (f"a prompt of {prompt_lengths[0]} tokens, up to {generated[0]} generated"
                   if len(prompt_lengths) == 1 else
                   f"{len(prompt_lengths)} prompts of {min(prompt_lengths)}-"
                   f"{max(prompt_lengths)} tokens, up to {max(generated)} generated each")
        if sum(bounds) > self.settings.max_saved_bytes:
            raise InterventionInputError("interventions", (
                f"the saves could take {sum(bounds) / 2**20:.2f} MiB ({prompts}); this server "
                f"allows {self.settings.max_saved_bytes / 2**20:g} MiB per request (its "
                "--interp-max-saved-mib): save fewer locations or positions, or lower "
                "max_tokens"))
        kept = sum(bound for bound in bounds if plan.saves == "id" or (
            plan.saves == "auto" and bound > self.settings.inline_bytes))
        if kept > self.settings.saves_budget_bytes:
            raise SavesOverBudget("interp_saves", (
                f"the saves could take {kept / 2**20:.2f} MiB ({prompts}), more than this "
                f"server keeps for all requests ({self.settings.saves_budget_bytes / 2**20:g} "
                "MiB, its --interp-saves-budget-mib): ask for them inline "
                "(\"interp_saves\": \"inline\"), save less, or lower max_tokens"))

    async def _check(self, ops: list[Op]) -> list[list[str]]:
        unknown = sorted({p for op in ops for p in op.patterns()} - set(self._resolved))
        if unknown:
            (answer, *_) = await self.engine.collective_rpc("interp_resolve", args=(unknown,))
            self._edit_refusals.update(answer.get("edit_refusals") or {})
            for pattern in unknown:
                refused = answer["errors"].get(pattern)
                self._resolved[pattern] = (refused if refused is not None
                                           else list(answer["resolved"][pattern]))
        acting_at: list[list[str]] = []
        for index, op in enumerate(ops):
            acting_at.append([])
            for pattern in op.patterns():
                found = self._resolved[pattern]
                if isinstance(found, str):
                    raise InterventionInputError(f"interventions[{index}].{op.PATTERN_FIELD}",
                                                 found)
                acting_at[-1].extend(found)
            try:
                check_op_fits(op, self.vocab_size, self.max_model_len)
            except ValueError as error:
                raise InterventionInputError(f"interventions[{index}]", str(error)) from None
        if (never := unservable(ops, acting_at, self._edit_refusals)) is not None:
            raise InterventionInputError(f"interventions[{never[0]}]", never[1])
        misfit = check_tensors_fit(ops, acting_at, self.shapes)
        if misfit is not None:
            raise InterventionInputError(*misfit)
        locations = sum(len(found) for found in acting_at)
        if locations > self.settings.max_locations:
            raise InterventionInputError("interventions", f"the ops act at {locations} locations; "
                                         f"this server allows {self.settings.max_locations} per "
                                         "request (its --interp-max-locations): send fewer, or "
                                         "split them over several requests")
        return acting_at

    async def results(self, plan: Plan, prompt_lengths: dict[int, int],
                      generated: dict[int, int]) -> dict[int, dict[str, Any]]:
        """Each finished engine request's `interp` (saves and error), by choice index (with
        `n=1`, a choice's index is its prompt's), collected from the worker in one call."""
        collected = await self._collect(plan, prompt_lengths, generated)
        return {index: self._interp(found, plan.saves) for index, found in enumerate(collected)}

    async def _collect(self, plan: Plan, prompt_lengths: dict[int, int],
                       generated: dict[int, int]) -> list[dict[str, Any]]:
        """What each of the plan's finished engine requests saved, and its error, in prompt
        order, from the worker in one call."""
        indices = range(len(plan.program_ids))
        finished = plan.finished([prompt_lengths.get(index, 0) for index in indices],
                                 [generated.get(index, 0) for index in indices])
        collected = await collect_async(self.engine, finished)
        return [collected.get(program_id, {}) for program_id in plan.program_ids]

    def _interp(self, collected: dict[str, Any], mode: str) -> dict[str, Any]:
        """One choice's `interp`: its saves inline or kept under an id (by `mode`, "auto" by
        their size), and its error."""
        saved = collected.get("saved", {})
        size = sum(tensor.numel() * tensor.element_size() for tensor in saved.values())
        result: dict[str, Any] = {"saves": None, "saves_id": None, "saves_bytes": size,
                                  "error": collected.get("error")}
        if mode == "inline" or (mode == "auto" and size <= self.settings.inline_bytes):
            result["saves"] = saves_to_json(saved)
            return result
        try:
            result["saves_id"], result["saves_bytes"] = self.kept.keep(saved)
        except KeptSavesFull as error:
            result["error"] = str(error)
        return result

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
                    last: dict[str, Any] = {key: counts.last.get(key) for key in (
                        "id", "object", "created", "model")}
                    # The fields vLLM's own last event has, so clients parse it as one.
                    empty: dict[str, Any] = ({"delta": {}} if last.get("object") ==
                                             "chat.completion.chunk" else {"text": ""})
                    last["choices"] = [{"index": index, **empty, "finish_reason": None,
                                        "interp": result} for index, result in results.items()]
                    finished = True
                    yield f"data: {json.dumps(last)}\n\n"
                    yield chunk
                elif chunk.startswith("data: "):
                    event = json.loads(chunk[len("data: "):])
                    counts.add(event, keep_token_ids)
                    # Unchanged unless token ids the client did not ask for were taken out.
                    yield chunk if keep_token_ids else f"data: {json.dumps(event)}\n\n"
                else:
                    yield chunk
        finally:
            if not finished:  # the client went away, or the engine failed mid-stream
                self.abandon(raw_request, plan)

    def abandon(self, raw_request: Request, plan: Plan) -> None:
        """After a request failed or its client went away: abort its engine requests, then free
        what they saved (in that order, so no later step saves for them)."""
        metadata = getattr(raw_request.state, "request_metadata", None)
        request_ids: list[str] = []
        if metadata is not None:
            # vLLM names a prompt's engine request "<id>-<i>" (completions), "<id>" or "<id>_<i>"
            # (chat); aborting a name that is not running does nothing.
            base = metadata.request_id
            request_ids = [base, *(f"{base}{mark}{i}" for i in range(len(plan.program_ids))
                                   for mark in "-_")]

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
