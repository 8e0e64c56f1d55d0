"""`AsyncLLM`: vLLM's asyncio engine — what `vllm serve` runs on — with `interventions=` on
`generate`, for Python programs that serve many requests at once (an agent loop, a web app).

Each `generate` call is one request, as in vLLM: its outputs stream as they come, and the last
one (`output.finished`) carries `output.saved` and `output.error` like `LLM.generate`'s. A
request that ends early (the caller stops iterating, or its task is cancelled) is aborted and
what it saved is freed. vLLM starts the engine core in a process of its own (spawned), so a
script that builds one needs `if __name__ == "__main__":` around it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import Any

from tokenspan import ReadMode
from vllm import SamplingParams

from vllm_runner.client.collection import collect_async, finished_output
from vllm_runner.client.engine_start import choose_defaults
from vllm_runner.client.llm import as_prompt_dict, checked_saes, prepare_engine
from vllm_runner.client.submission import Submission
from vllm_runner.ops import Op
from vllm_runner.ops.limits import check_op_fits
from vllm_runner.ops.locations import checked_resolution, refuse_what_cannot_be_served
from vllm_runner.ops.program import check_ops
from vllm_runner.settings import SAES_KEY, SAESpec, saes_config

logger = logging.getLogger("vllm.interp")


class AsyncLLM:
    """vLLM's `AsyncLLM` with per-request interventions (see the module's docstring)."""

    def __init__(self, model: str | None = None, interp_reads: ReadMode | None = None,
                 interp_device_saves_mib: int | None = None,
                 taps: str | Sequence[str] | None = None,
                 graph_taps: str | Sequence[str] | None = None,
                 saes: Mapping[str, SAESpec] | None = None,
                 **engine: Any) -> None:
        """Start vLLM's asyncio engine on `model` (the embedded SmolLM2-135M-Instruct when
        `None`) with every engine argument in `engine`; the `interp_*` settings, `taps`,
        `graph_taps` and `saes` as for `LLM` (`await llm.saes()` says where each SAE reads,
        and raises `SAEsRefused` for those the workers refused)."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM as VllmAsyncLLM

        model = prepare_engine(model, engine, interp_reads, interp_device_saves_mib, taps,
                               graph_taps, saes)
        chosen = choose_defaults(model, engine, current_platform.is_cpu())
        self._default_interventions: tuple[Op, ...] = ()
        self.engine = VllmAsyncLLM.from_engine_args(AsyncEngineArgs(model=model, **engine))
        if chosen:
            logger.info(chosen)

    @property
    def default_interventions(self) -> list[Op]:
        """The program a `generate` call runs when it gives no `interventions` (as
        `LLM.default_interventions`; `interventions=[]` runs none). Set it at any time; an
        unknown location in it is refused by the next `generate` that runs it (resolving
        needs the engine, which a property cannot wait for)."""
        return list(self._default_interventions)

    @default_interventions.setter
    def default_interventions(self, ops: Sequence[Op]) -> None:
        check_ops(ops, "default_interventions")
        self._default_interventions = tuple(ops)

    def __getattr__(self, name: str) -> Any:
        """Everything else is vLLM's `AsyncLLM`'s (`abort`, `shutdown`, `get_tokenizer`, ...)."""
        if name == "engine":
            raise AttributeError("this AsyncLLM has no engine: its construction failed")
        return getattr(self.engine, name)

    async def saes(self) -> dict[str, dict[str, Any]]:
        """The engine's SAEs by name (as `LLM.saes`); `SAEsRefused` naming those the workers
        refused at start-up."""
        (answer, *_) = await self.engine.collective_rpc("interp_saes")
        return checked_saes(answer)

    async def load_saes(self, saes: Mapping[str, SAESpec]) -> None:
        """Load more SAEs into the running engine (as `LLM.load_saes`)."""
        paths = saes_config(dict(saes))[SAES_KEY]
        (answer, *_) = await self.engine.collective_rpc("interp_load_saes", args=(paths,))
        checked_saes(answer, paths)

    async def resolve(self, patterns: Sequence[str]) -> dict[str, list[str]]:
        """The canonical locations each pattern names; `LocationError` for one that names
        nothing (as `LLM.resolve`)."""
        return dict((await self._resolution(patterns))["resolved"])

    async def _resolution(self, patterns: Sequence[str]) -> dict[str, Any]:
        wanted = sorted(set(patterns))
        return checked_resolution(
            (await self.engine.collective_rpc("interp_resolve", args=(wanted,)))[0] if wanted
            else None)

    async def generate(self, prompt: Any, sampling_params: SamplingParams, request_id: str,
                       *, interventions: Sequence[Op] | None = None,
                       **kwargs: Any) -> AsyncGenerator[Any, None]:
        """vLLM's `AsyncLLM.generate`, running `interventions` on this request; every output
        has `saved` and `error` (filled on the last one); without `interventions`, the
        `default_interventions`."""
        if interventions is None:
            interventions = self._default_interventions
        if not interventions:
            async for output in self.engine.generate(prompt, sampling_params, request_id,
                                                     **kwargs):
                yield _with_results(output, {}, None)
            return
        ops = list(interventions)
        await self._check(ops, sampling_params)
        submission = Submission.of(ops)
        params = sampling_params.clone()  # the caller's object is not changed
        program_id = submission.attach(params)
        request: Any = as_prompt_dict(prompt)  # a TextPrompt or TokensPrompt dict
        request["cache_salt"] = submission.salt(request.get("cache_salt"))
        collected = False
        try:
            async for output in self.engine.generate(request, params, request_id, **kwargs):
                _with_results(output, {}, None)
                if output.finished:
                    await self._collect(output, program_id)
                    collected = True
                yield output
        finally:
            if not collected:  # stopped early: nobody will collect it
                await self.engine.abort(request_id)
                await self.engine.collective_rpc("interp_drop", args=([program_id],))

    async def _check(self, ops: list[Op], params: SamplingParams) -> None:
        if params.n > 1:
            raise ValueError(f"SamplingParams(n={params.n}) with interventions: the {params.n} "
                             "samples would share one program's saves; send n requests")
        answer = await self._resolution([pattern for op in ops for pattern in op.patterns()])
        refuse_what_cannot_be_served([ops], answer)
        model_config = self.engine.model_config
        for op in ops:
            check_op_fits(op, int(model_config.get_vocab_size()),
                          int(model_config.max_model_len))

    async def _collect(self, output: Any, program_id: str) -> None:
        collected = await collect_async(self.engine, [finished_output(output, program_id)])
        result = collected.get(program_id, {})
        _with_results(output, result.get("saved", {}), result.get("error"))
        if output.error is not None:
            logger.warning("request %s: its program failed; its text still came back "
                           "(output.error says where and why): %s", output.request_id,
                           output.error)


def _with_results(output: Any, saved: dict[str, Any], error: str | None) -> Any:
    """`output` with `saved` and `error` set (vLLM's `RequestOutput` has neither)."""
    output.saved, output.error = saved, error
    return output
