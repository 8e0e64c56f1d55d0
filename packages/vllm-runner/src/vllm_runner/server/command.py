"""`vllm-interp serve MODEL [vllm serve options]`: vLLM's own `vllm serve`, with the
interpretability worker and routes (`vllm_runner.server`) and the engine settings hooks need.

Every `vllm serve` option keeps its meaning; this adds only what the user left out:
`--worker-cls` (the worker that runs programs), on a CPU `--enforce-eager` unless the user
asked for `--no-enforce-eager` (as `LLM`'s default, `engine_start.eager_by_default`; on a GPU
vLLM's compiled engine: steps with programs at locations no tap serves run uncompiled, the
rest compiled), on a CPU a KV cache that fits the machine (as `LLM` does), and `vllm_interp`
in `VLLM_PLUGINS`, without which vLLM loads no endpoint plugin.
`--interp-taps` / `--interp-graph-taps` become the engine's taps (`LLM(taps=, graph_taps=)`), and
each `--interp-sae NAME=PATH` one of its SAEs (`LLM(saes=...)`), in vLLM's
`--additional-config`; the other `--interp-*` options are the operator's settings of the
interventions (`server.settings`). Both are taken out before vLLM parses.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

from vllm_runner.client.engine_start import eager_by_default
from vllm_runner.server import PLUGIN_NAME
from vllm_runner.server.settings import (
    SAE_OPTION,
    TAP_OPTIONS,
    ServerSettings,
    option_value,
    split_options,
)
from vllm_runner.settings import sae_option, saes_config, taps_config

PLUGINS_VARIABLE = "VLLM_PLUGINS"
CPU_WORKER = "vllm_runner.engine.cpu_worker.InterpCPUWorker"
GPU_WORKER = "vllm_runner.engine.worker.InterpGPUWorker"


def _given(options: Sequence[str], name: str) -> bool:
    return any(option == name or option.startswith(f"{name}=") for option in options)


def _ranks(options: Sequence[str]) -> int:
    """The tensor-parallel size the options ask for (1 if none)."""
    for index, option in enumerate(options):
        for name in ("--tensor-parallel-size", "-tp"):
            if option == name and index + 1 < len(options):
                return int(options[index + 1])
            if option.startswith(f"{name}="):
                return int(option.split("=", 1)[1])
    return 1


def serve_command(model: str, options: Sequence[str], on_cpu: bool,
                  kv_cache_bytes: int | None) -> list[str]:
    """The `vllm serve` arguments for `vllm-interp serve MODEL OPTIONS` (pure: tested as is).
    `kv_cache_bytes` is the CPU KV cache to ask for when the user sized none."""
    command = ["serve", model, *options]
    if not _given(options, "--worker-cls"):
        command += ["--worker-cls", CPU_WORKER if on_cpu else GPU_WORKER]
    chose = _given(options, "--enforce-eager") or _given(options, "--no-enforce-eager")
    if not chose and eager_by_default(on_cpu):
        command.append("--enforce-eager")
    sized = _given(options, "--gpu-memory-utilization") or _given(options,
                                                                  "--kv-cache-memory-bytes")
    if on_cpu and not sized and kv_cache_bytes is not None:
        command += ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
    return command


def with_additional_config(options: Sequence[str]) -> list[str]:
    """The options with `--interp-taps PATTERNS` and `--interp-graph-taps PATTERNS`
    (comma-separated location patterns) and each `--interp-sae NAME=PATH` turned into vLLM's
    `--additional-config`, merged into the user's own if given (pure but for the check that
    each SAE's path exists: tested as is); unchanged without them."""
    rest: list[str] = []
    taps: dict[str, list[str]] = {name: [] for name in TAP_OPTIONS}
    saes: dict[str, str | tuple[str, str]] = {}
    config_text = None
    pending = list(options)
    while pending:
        option = pending.pop(0)
        name, has_value, value = option.partition("=")
        if name not in taps and name not in ("--additional-config", SAE_OPTION):
            rest.append(option)
            continue
        value = option_value(name, has_value, value, pending)
        if name == "--additional-config":
            config_text = value
            continue
        if name == SAE_OPTION:
            sae_name, spec = sae_option(value, SAE_OPTION)
            if sae_name in saes:
                raise ValueError(f"{SAE_OPTION}: the name {sae_name!r} is given twice")
            saes[sae_name] = spec
            continue
        patterns = [pattern.strip() for pattern in value.split(",") if pattern.strip()]
        if not patterns:
            raise ValueError(f"{name} {value!r}: give location patterns, comma-separated, e.g. "
                             f"{name} 'layers.*.layer_output'")
        taps[name] += patterns
    if not any(taps.values()) and not saes:
        return list(options)
    try:
        config = json.loads(config_text) if config_text is not None else {}
    except json.JSONDecodeError as error:
        raise ValueError(f"--additional-config {config_text!r} is not JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--additional-config {config_text!r}: give a JSON object")
    if any(taps.values()):
        config.update(taps_config(taps["--interp-taps"], taps["--interp-graph-taps"]))
    if saes:
        config.update(saes_config(saes))
    return [*rest, "--additional-config", json.dumps(config)]


def plugins_setting(current: str | None) -> str:
    """`VLLM_PLUGINS` with our endpoint plugin named. Unset, vLLM loads every general plugin and
    no endpoint plugin; set, it loads only those it names — so other installed general plugins
    are lost once we set it, unless the user listed them (then theirs are kept)."""
    names = [name for name in (current or "").split(",") if name.strip()]
    return ",".join([*names, PLUGIN_NAME] if PLUGIN_NAME not in names else names)


def model_and_options(given: Sequence[str]) -> tuple[str | None, list[str]]:
    """`[MODEL] OPTIONS` split as `vllm serve` reads them (a model, if any, comes first)."""
    if given and not given[0].startswith("-"):
        return given[0], list(given[1:])
    return None, list(given)


def embedded_defaults(options: Sequence[str]) -> list[str]:
    """What serving the embedded model adds to the options the user left out: float32 (the
    CPU build would serve the float32 checkpoint in bfloat16) and its own name as the served
    model's (not the cache folder's path)."""
    from vllm_runner.client.embedded import NAME

    added = []
    if not _given(options, "--dtype"):
        added += ["--dtype", "float32"]
    if not _given(options, "--served-model-name"):
        added += ["--served-model-name", NAME]
    return [*options, *added]


def run_serve(given: Sequence[str]) -> None:
    """Replace this process with `vllm serve` as `server.command` builds it (signals, logs and
    the exit status are vLLM's own); without a model, the embedded one. An unchecked vLLM
    release is refused first, as `LLM` refuses it."""
    import vllm
    from vllm.platforms import current_platform

    from vllm_runner.engine.compat import check_version

    check_version(vllm.__version__)

    model, options = model_and_options(given)
    if model is None:
        from vllm_runner.client.embedded import default_model

        model = default_model(lambda line: print(line, file=sys.stderr, flush=True))
        options = embedded_defaults(options)

    from vllm_runner.client.engine_start import CPU_KV_CACHE_VARIABLE, default_cpu_kv_cache

    options, interp_environment = split_options(with_additional_config(options))
    on_cpu = current_platform.is_cpu()
    kv_cache_bytes = None
    if on_cpu and not os.environ.get(CPU_KV_CACHE_VARIABLE):
        kv_cache_bytes, _free, _node = default_cpu_kv_cache(model, _ranks(options))
    command = serve_command(model, options, on_cpu, kv_cache_bytes)
    os.environ.update(interp_environment)
    ServerSettings.from_environment()  # a bad --interp-* value is refused before vLLM starts
    os.environ[PLUGINS_VARIABLE] = plugins_setting(os.environ.get(PLUGINS_VARIABLE))
    print("vllm-interp serve: vllm " + " ".join(command), file=sys.stderr, flush=True)
    os.execv(sys.executable, [sys.executable, "-m", "vllm_runner.server.main", *command])
