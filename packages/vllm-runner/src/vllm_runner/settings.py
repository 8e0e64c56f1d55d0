"""Engine-wide settings that must reach the worker processes.

vLLM starts its workers in processes of their own (engine core, tensor-parallel ranks), which
inherit the client's environment when they start and nothing the client sets later. A setting
for the workers is therefore an environment variable, set before the engine starts.
"""

from __future__ import annotations

import os
from typing import Any, cast

from tokenspan import READ_MODES, ReadMode

from vllm_runner.saves import shm_files

#: Where an engine's taps (`LLM(taps=...)`) travel to its workers: a key of vLLM's
#: `additional_config`, which is the engine's own (an environment variable would reach every
#: later engine of the process) and part of the config's hash (a model compiled for other taps
#: is never taken from vLLM's compile cache).
TAPS_KEY = "interp_taps"
#: The taps whose `ProjectOut`s, `Add`s and `Save`s run inside the graph
#: (`LLM(graph_taps=...)`), likewise.
GRAPH_TAPS_KEY = "interp_graph_taps"


#: Where an engine's SAEs (`LLM(saes={name: folder})`) travel to its workers, likewise: each
#: worker loads them once at start-up.
SAES_KEY = "interp_saes"


def taps_config(taps: list[str], graph_taps: list[str]) -> dict[str, list[str]]:
    """The taps' entries of vLLM's `additional_config` (`LLM(taps=, graph_taps=)` and
    `vllm-interp serve --interp-taps/--interp-graph-taps`): every tap once, graph taps included."""
    return {TAPS_KEY: list(dict.fromkeys([*taps, *graph_taps])), GRAPH_TAPS_KEY: graph_taps}


#: An SAE as `LLM(saes=...)` takes it: its folder or file, or `(path, site)` for files that
#: name no site.
SAESpec = str | os.PathLike[str] | tuple[str | os.PathLike[str], str]


def saes_config(saes: Any) -> dict[str, dict[str, dict[str, str | None]]]:
    """The SAEs' entry of vLLM's `additional_config` (`LLM(saes=...)`, `vllm-interp serve
    --interp-sae NAME=PATH`): each name to its absolute path (workers may start elsewhere) and
    the site given for files that name none (`(path, site)`: Gemma Scope's `params.npz`), or
    `None`; refused by name unless each name is a word and each path exists, before an engine
    starts."""
    if not isinstance(saes, dict) or not saes:
        raise ValueError(f"saes={saes!r}: give a dict of names to SAE folders, e.g. "
                         "saes={'res12': '/path/to/sae'}")
    found: dict[str, dict[str, str | None]] = {}
    for name, given in saes.items():
        if not isinstance(name, str) or not name or any(c.isspace() or c in ":/@" for c in name):
            raise ValueError(f"saes: {name!r} is not a usable SAE name: give a word without "
                             "spaces, ':', '/' or '@', e.g. 'res12'")
        path, site = given if isinstance(given, (tuple, list)) and len(given) == 2 \
            else (given, None)
        if site is not None and (not isinstance(site, str) or not site):
            raise ValueError(f"saes[{name!r}]: site {site!r} must be a site name, e.g. "
                             "'blocks.12.hook_resid_post' or 'model.layers.12.output'")
        if not isinstance(path, (str, os.PathLike)) or not os.path.exists(path):
            raise ValueError(f"saes[{name!r}]: {path!r} does not exist; give the folder (or "
                             "file) the SAE's weights are in, or (path, site) for files that "
                             "name no site")
        found[name] = {"path": os.path.abspath(path), "site": site}
    return {SAES_KEY: found}


def sae_option(value: str, option: str) -> tuple[str, str | tuple[str, str]]:
    """`NAME=PATH` or `NAME=PATH@SITE` (`--interp-sae`, `extract --sae`) as a name and what
    `saes_config` takes; refused naming `option` unless it has a name and a path."""
    name, equals, path = value.partition("=")
    if not equals or not name or not path:
        raise ValueError(f"{option} {value!r}: give NAME=PATH (or NAME=PATH@SITE for files that "
                         f"name no site), e.g. {option} res12=/path/to/sae")
    where, at, site = path.rpartition("@")
    return (name, (where, site)) if at and where and site else (name, path)


def refused_saes_message(refused: dict[str, str]) -> str:
    """Why the engine's workers refused SAEs (name -> reason), in one line."""
    return "; ".join(f"SAE {name!r}: {reason}" for name, reason in refused.items())


def refused_taps_message(refused: dict[str, str]) -> str:
    """Why the engine's workers refused tap patterns (pattern -> reason), in one line: what
    `LLM` raises and what stops `vllm-interp serve`, rather than start with a tap that would
    never serve."""
    return "; ".join(f"tap {pattern!r}: {reason}" for pattern, reason in refused.items())


#: Whether saves cross from an engine core in a process of its own to its client through files in
#: shared memory ("1", the default: `shm_files`) or inside vLLM's messages ("0").
SHARED_SAVES_VARIABLE = "VLLM_INTERP_SHARED_SAVES"


def shared_saves_memory() -> str | None:
    """Which shared memory this process sees (`shm_files.identity`), which a worker compares
    with its own before it sends saves through it (a file it wrote elsewhere could not be
    opened here), or `None` where the `VLLM_INTERP_SHARED_SAVES` setting is "0"."""
    given = os.environ.get(SHARED_SAVES_VARIABLE, "1")
    if given not in ("0", "1"):
        raise ValueError(f"{SHARED_SAVES_VARIABLE}={given!r} must be 1 (saves through shared "
                         "memory, the default) or 0 (inside vLLM's messages)")
    return shm_files.identity() if given == "1" else None


#: Whether a compiled engine with taps also captures its full CUDA graphs broken at the taps
#: (V2 on a GPU; "1", the default: a step whose programs need a tap's Python replays them;
#: "0": such a step runs the piecewise graphs, and start-up captures no more graphs than vLLM).
BREAK_AT_TAPS_VARIABLE = "VLLM_INTERP_BREAK_AT_TAPS"


def breaks_at_taps() -> bool:
    """The `VLLM_INTERP_BREAK_AT_TAPS` setting: whether full graphs are captured again, broken
    at the taps (refused unless "0" or "1"). "0" trades the speed of steps with a tap's Python
    for start-up time and graph memory, and tells what the broken captures cost the other
    steps (`benchmarks/compiled_bench.py`'s `nobreaks` arm)."""
    given = os.environ.get(BREAK_AT_TAPS_VARIABLE, "1")
    if given not in ("0", "1"):
        raise ValueError(f"{BREAK_AT_TAPS_VARIABLE}={given!r} must be 1 (full graphs are also "
                         "captured broken at the taps, the default) or 0 (they are not)")
    return given == "1"


#: How values are lent to `Call` functions unless an op says otherwise (see `ops.Call`).
READS_VARIABLE = "VLLM_INTERP_READS"


def read_mode(value: str | None = None) -> ReadMode:
    """`value`, or the `VLLM_INTERP_READS` setting, or `"lease"`; refused if not a read mode."""
    mode = value if value is not None else os.environ.get(READS_VARIABLE, "lease")
    if mode not in READ_MODES:
        raise ValueError(f"read mode {mode!r} (LLM(interp_reads=) or {READS_VARIABLE}) must be "
                         f"one of {', '.join(READ_MODES)}")
    return cast(ReadMode, mode)


#: How many MiB of saves a worker keeps on its GPU before moving them to the host.
DEVICE_SAVES_VARIABLE = "VLLM_INTERP_DEVICE_SAVES_MIB"
#: Used when neither the setting nor the device says how much memory is free.
FALLBACK_DEVICE_SAVES_MIB = 1024


def device_saves_limit(value: int | str | None = None) -> int | None:
    """`value` MiB, or the `VLLM_INTERP_DEVICE_SAVES_MIB` setting, in bytes; `None` when
    neither is given: the worker then keeps up to half of the GPU memory free when its first
    save lands (`SaveStore.spill`).

    Saves stay on the GPU while a request runs (a copy to the host at every save would stall
    the GPU), in memory outside vLLM's `gpu_memory_utilization` budget; past this limit they
    are moved to the host at the start of the next step, so saving every layer over long
    generations cannot exhaust the GPU. 0 moves them at every step."""
    given = value if value is not None else os.environ.get(DEVICE_SAVES_VARIABLE)
    if given is None:
        return None
    try:
        mib = int(given)
    except (TypeError, ValueError):
        mib = -1
    if mib < 0 or isinstance(given, float | bool):
        raise ValueError(f"device saves limit {given!r} (LLM(interp_device_saves_mib=) or "
                         f"{DEVICE_SAVES_VARIABLE}) must be a whole number of MiB, 0 or more")
    return mib * 2**20
