"""Extract activations for many prompts to disk: streamed in shards, resumable, bounded memory.

Format: a folder of safetensors shards plus `manifest.json`. Shard `k` holds prompts
`[k * shard_size, (k + 1) * shard_size)`; for prompt `i` it stores `"<i>/token_ids"` and
`"<i>/<canonical location>"` (the saved value without its batch axis: `[positions, ...]`), and
for each SAE whose features it extracts `"<i>/<sae>.features.indices"` and
`"<i>/<sae>.features.values"` (`[positions, top_k]`, sparse: `ops.Features`).
Why safetensors: every framework reads it (torch, numpy, JAX) without pickle, a shard can be
memory-mapped and read one tensor at a time, and prompts of different lengths stay separate
tensors instead of padded blocks; `datasets`/Arrow would add a large dependency and flatten the
tensors. `load` reads a folder back.

The folder may be any fsspec URL (`s3://bucket/prefix`, ...: `extract_store`), and
`extract_ray` writes the same folder from engine replicas over a Ray cluster.

Resuming: a shard is written whole (a local file renamed into place, an object uploaded whole),
and only then recorded in the manifest (itself replaced whole). A run killed at any moment
leaves at worst a shard written but not recorded, or a local `.partial` file; the next run with
the same settings records the first (`open_manifest`) and redoes exactly the shards the folder
lacks, so every row is written exactly once.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from vllm_runner import ops
from vllm_runner.cli.extract_store import MANIFEST, ExtractionStore, shard_name
from vllm_runner.errors import InterventionError

FORMAT = "vllm-interp-extract/1"


class ExtractionMismatch(ValueError):
    """The output folder holds an extraction made with different settings."""


def read_prompts(path: str | Path) -> list[str]:
    """Prompts from a text file (one per line, blank lines skipped) or a JSONL file (a
    `"prompt"` field per line)."""
    path = Path(path)
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if path.suffix != ".jsonl":
        return lines
    prompts = []
    for number, line in enumerate(lines, 1):
        record = json.loads(line)
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ValueError(f"{path}:{number}: expected a JSON object with a string 'prompt'")
        prompts.append(record["prompt"])
    return prompts


def extract(llm: Any, prompts: Sequence[str], locations: Sequence[str], out: str | Path, *,
            positions: Sequence[int] | None = None, shard_size: int = 64,
            model_name: str = "", progress: bool = True,
            features: dict[str, int | None] | None = None) -> str | Path:
    """Run `prompts` through `llm` saving `locations` (patterns), and the features of the SAEs
    `features` names (an SAE of `llm` -> how many features per token: `ops.Features`'s `top_k`),
    and write them to `out` (a folder, or any fsspec URL: `extract_store`).

    Each prompt's values are what `llm.generate(..., interventions=[ops.Save(...)])` saves for
    it, run with `max_tokens=1`, so they cover the prompt's positions (`positions` keeps some:
    absolute, or negative from the end of the prompt). Returns `out`. Raises
    `ExtractionMismatch` if `out` holds an extraction with other settings, and
    `InterventionError` naming the prompt if a program fails (shards written so far are kept).
    """
    from tqdm import tqdm

    if shard_size < 1:
        raise ValueError(f"shard_size must be at least 1, got {shard_size}")
    features = dict(features or {})
    store, settings = checked_folder(out, prompts, locations, positions, shard_size, model_name,
                                     features)
    check_locations(llm, locations, features)  # now, not after the first shard
    manifest = open_manifest(store, settings)
    done = {shard["index"] for shard in manifest["shards"]}
    program = extraction_program(locations, positions, features)
    count = -(-len(prompts) // shard_size)
    finished = sum(min(shard_size, len(prompts) - i * shard_size) for i in done)
    bar = tqdm(total=len(prompts), initial=finished, unit="prompt", disable=not progress,
               desc="extract")
    tokens, started = 0, time.perf_counter()
    try:
        for index in range(count):
            if index in done:
                continue
            first = index * shard_size
            batch = list(prompts[first:first + shard_size])
            tensors, batch_tokens = unit_tensors(llm, batch, first, program)
            store.write_shard(shard_name(index), tensors, {"first": str(first)},
                              before_rename=partial(_crash_point_for_tests,
                                                    len(manifest["shards"])))
            record_shard(store, manifest, index)
            tokens += batch_tokens
            bar.update(len(batch))
            bar.set_postfix(tokens_per_s=f"{tokens / (time.perf_counter() - started):.0f}")
    finally:
        bar.close()
    return out


def check_locations(llm: Any, locations: Sequence[str], features: dict[str, int | None]
                    ) -> None:
    """`LocationError` naming a location pattern, or an SAE of `features`, that `llm` does not
    serve: asked of the engine before any prompt runs."""
    llm.resolve([*locations, *(ops.Features(sae=name).location for name in features)])


def extraction_program(locations: Sequence[str], positions: Sequence[int] | None,
                       features: dict[str, int | None]) -> list[ops.Op]:
    """The program each prompt of an extraction runs: a save per location pattern and the
    features of each SAE, at `positions` (all when `None`)."""
    kept = None if positions is None else tuple(positions)
    program: list[ops.Op] = [ops.Save(location, positions=kept) for location in locations]
    program += [ops.Features(sae=name, top_k=top_k, positions=kept)
                for name, top_k in features.items()]
    return program


def unit_tensors(llm: Any, batch: Sequence[str], first: int, program: Sequence[ops.Op]
                 ) -> tuple[dict[str, torch.Tensor], int]:
    """One shard's tensors for `batch`, the prompts numbered from `first` (see the module for
    the names), and how many prompt tokens they held. `InterventionError` naming the prompt
    whose program failed."""
    from vllm import SamplingParams

    outputs = llm.generate(list(batch), SamplingParams(max_tokens=1, temperature=0.0),
                           interventions=list(program), use_tqdm=False)
    tensors: dict[str, torch.Tensor] = {}
    tokens = 0
    for offset, output in enumerate(outputs):
        number = first + offset
        if output.error is not None:
            raise InterventionError(f"prompt {number} ({batch[offset][:60]!r}): {output.error}")
        tensors[f"{number}/token_ids"] = torch.tensor(output.prompt_token_ids)
        for location, value in output.saved.items():
            tensors[f"{number}/{location}"] = value[0].contiguous()
        tokens += len(output.prompt_token_ids)
    return tensors, tokens


def extraction_settings(prompts: Sequence[str], locations: Sequence[str],
                        positions: Sequence[int] | None, shard_size: int, model_name: str,
                        features: dict[str, int | None] | None = None) -> dict[str, Any]:
    """What an extraction folder records, and a resumed run must match."""
    return {"format": FORMAT, "model": model_name, "locations": list(locations),
            **({"features": dict(features)} if features else {}),
            "positions": None if positions is None else list(positions),
            "shard_size": shard_size, "prompts": len(prompts),
            "prompts_sha256": _digest(prompts)}


def resumable(out: str | Path, prompts: Sequence[str], locations: Sequence[str], *,
              positions: Sequence[int] | None = None, shard_size: int = 64,
              model_name: str = "", features: dict[str, int | None] | None = None) -> None:
    """Check, without writing or starting anything, that `extract` with these settings can
    write to `out` (empty, new, or an extraction with the same settings): `ExtractionMismatch`
    naming what differs otherwise. The command runs it before its engine's slow start."""
    checked_folder(out, prompts, locations, positions, shard_size, model_name, features)


def checked_folder(out: str | Path, prompts: Sequence[str], locations: Sequence[str],
                   positions: Sequence[int] | None, shard_size: int, model_name: str,
                   features: dict[str, int | None] | None
                   ) -> tuple[ExtractionStore, dict[str, Any]]:
    """`resumable`'s check; the folder's store and the settings it records (the prompts hashed
    once)."""
    store = ExtractionStore(out)
    settings = extraction_settings(prompts, locations, positions, shard_size, model_name,
                                   features)
    _check_folder(store, settings)
    return store, settings


def _check_folder(store: ExtractionStore, settings: dict[str, Any]) -> None:
    if store.is_file():
        raise ExtractionMismatch(f"{store.url} is a file, not a folder; choose a new --out")
    manifest = store.read_manifest()
    if manifest is None:
        if store.shard_indices():
            raise ExtractionMismatch(f"{store.url} holds shards but no {MANIFEST}; use an "
                                     "empty folder")
        return
    recorded = manifest.get("settings", {})
    if recorded != settings:
        changed = sorted(key for key in settings if recorded.get(key) != settings[key])
        raise ExtractionMismatch(
            f"{store.url} holds an extraction with other settings ({', '.join(changed)} "
            "differ); resume with the same arguments, or choose a new --out")


def open_manifest(store: ExtractionStore, settings: dict[str, Any]) -> dict[str, Any]:
    """The folder's manifest (checked by `resumable` first), or a new one; shards written whole
    but not yet recorded (their writer died between the two) are recorded now, so a resumed
    run never writes them again."""
    manifest = store.read_manifest() or {"settings": settings, "shards": []}
    listed = {shard["index"] for shard in manifest["shards"]}
    found = store.shard_indices() - listed
    for index in sorted(found):
        _add_shard(manifest, index)
    if found or not listed:
        store.write_manifest(manifest)
    return manifest


def record_shard(store: ExtractionStore, manifest: dict[str, Any], index: int) -> None:
    """Record shard `index`, written whole, in the manifest (replaced whole)."""
    _add_shard(manifest, index)
    store.write_manifest(manifest)


def _add_shard(manifest: dict[str, Any], index: int) -> None:
    settings = manifest["settings"]
    first = index * settings["shard_size"]
    manifest["shards"].append({"index": index, "file": shard_name(index), "first": first,
                               "count": min(settings["shard_size"],
                                            settings["prompts"] - first)})
    manifest["shards"].sort(key=lambda shard: shard["index"])


def load(out: str | Path) -> Iterator[dict[str, Any]]:
    """Each extracted prompt in order: `{"index", "token_ids", <canonical location>: tensor}`,
    from a folder or any fsspec URL.

    Reads one shard at a time. Raises `ValueError` if the extraction is not complete.
    """
    store = ExtractionStore(out)
    manifest = store.read_manifest()
    if manifest is None:
        raise ValueError(f"{store.url} holds no extraction ({MANIFEST} is missing)")
    settings = manifest["settings"]
    expected = -(-settings["prompts"] // settings["shard_size"])
    if len(manifest["shards"]) != expected:
        raise ValueError(f"{store.url}: {len(manifest['shards'])} of {expected} shards written; "
                         "run the same extraction again to finish it")
    for shard in manifest["shards"]:
        tensors = store.read_shard(shard["file"])
        for number in range(shard["first"], shard["first"] + shard["count"]):
            prefix = f"{number}/"
            record: dict[str, Any] = {"index": number}
            record.update({key[len(prefix):]: value for key, value in tensors.items()
                           if key.startswith(prefix)})
            yield record


def _digest(prompts: Sequence[str]) -> str:
    digest = hashlib.sha256()
    for prompt in prompts:
        digest.update(prompt.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def _crash_point_for_tests(written: int) -> None:
    """Die like a killed process between writing a shard and recording it, after `written`
    shards — the worst moment — when `VLLM_INTERP_EXTRACT_CRASH_AFTER` asks for it (tests)."""
    crash_after = os.environ.get("VLLM_INTERP_EXTRACT_CRASH_AFTER")
    if crash_after is not None and written >= int(crash_after):
        os._exit(17)
