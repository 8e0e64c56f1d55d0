"""`vllm-interp extract --ray`: one extraction spread over engine replicas on a Ray cluster,
written to one folder at any fsspec URL (`s3://bucket/prefix`, ...), in `extract`'s format.

The prompts are cut into units, one per shard (`shard_size` prompts). Ray Data runs them through
a pool of `replicas` actors (`map_batches` with a class and an `ActorPoolStrategy`), each
holding one `LLM` for its lifetime; a replica writes each of its units' shard itself, straight
to the URL, and the driver records the shards in the manifest as their units come back, with
one progress bar for the run. Ray Data schedules the units, restarts a replica that dies, and
runs the unit it held again.

Nothing is written twice or half: a shard is written whole (`extract_store`) under its unit's
fixed name, and a replica skips a unit whose shard is already there — the retry of a unit whose
replica died after writing it, or a unit another run finished. A run that dies (the driver, or
the cluster) is resumed by running it again: units whose shards exist are never sent (those
written but not recorded are recorded first: `extract.open_manifest`), units in flight are
redone whole. Ray Data's own writers name their files at random and keep no record of what a
run finished, so they could not resume; hence the replicas write.

On a GPU cluster a replica asks Ray for `replica_gpus` GPUs (its engine's ranks: vLLM's own
executor spreads a replica over them) and `replica_cpus` CPUs; the variables that reach object
storage and the engine (`FORWARDED_PREFIXES`) go to the replicas with the job.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_runner.cli.extract import (
    check_locations,
    checked_folder,
    extraction_program,
    open_manifest,
    record_shard,
    unit_tensors,
)
from vllm_runner.cli.extract_store import ExtractionStore, shard_name
from vllm_runner.errors import InterpError

#: Linux's longest Unix socket path, and what a Ray session adds to its temporary folder for
#: its longest socket (`/ray/session_<date>_<time>_<microseconds>_<pid>/sockets/plasma_store`).
SOCKET_PATH_LIMIT = 107
RAY_SOCKET_SUFFIX = len("/ray/session_YYYY-MM-DD_hh-mm-ss_uuuuuu_ppppppp/sockets/plasma_store")

#: Variables of the driver's environment that the replicas get too (on another machine they
#: would not otherwise): object-store endpoints and credentials, the hub's token, vLLM's and our
#: own settings.
FORWARDED_PREFIXES = ("AWS_", "FSSPEC_", "GOOGLE_", "AZURE_", "HF_", "VLLM_")


class Replica:
    """One engine replica, in a Ray actor: an `LLM` started once, writing the shards of the
    units Ray Data gives it (`{"index", "first", "prompts"}` rows, one per batch)."""

    def __init__(self, model: str | None, engine: dict[str, Any], out: str,
                 locations: Sequence[str], positions: Sequence[int] | None,
                 features: dict[str, int | None]) -> None:
        from vllm_runner.client.llm import LLM

        self.store = ExtractionStore(out)
        self.program = extraction_program(locations, positions, features)
        #: Why this replica cannot run (a bad location or SAE, an engine that did not start),
        #: given back for its first unit: Ray reports an error raised here only as text inside
        #: its own errors.
        self.refused: Exception | None = None
        try:
            self.llm = LLM(model, **engine)
            check_locations(self.llm, locations, features)
        except (InterpError, ValueError) as error:
            self.refused = error

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[Any]]:
        """Each unit's index, the prompt tokens it ran, and the error that stopped it, pickled
        (`b""` if none): the driver raises it as it was raised here (`InterventionError` naming
        the prompt, `LocationError`, ...), where an error raised out of a Ray Data task reaches
        the driver wrapped, without its cause."""
        answer: dict[str, list[Any]] = {"index": [], "tokens": [], "error": []}
        for index, first, prompts in zip(batch["index"], batch["first"], batch["prompts"],
                                         strict=True):
            name = shard_name(int(index))
            written, error = 0, b""
            try:
                if self.refused is not None:
                    raise self.refused
                if not self.store.has(name):  # else a retry of a unit its last attempt wrote
                    tensors, written = unit_tensors(self.llm, [str(p) for p in prompts],
                                                    int(first), self.program)
                    self.store.write_shard(name, tensors, {"first": str(int(first))})
            except (InterpError, ValueError) as failed:
                error = pickle.dumps(failed)
            answer["index"].append(int(index))
            answer["tokens"].append(written)
            answer["error"].append(error)
        return answer


def extract_on_ray(prompts: Sequence[str], locations: Sequence[str], out: str | Path, *,
                   model: str | None, engine: dict[str, Any], replicas: int,
                   address: str | None = None, replica_cpus: float = 1.0,
                   replica_gpus: float = 0.0, positions: Sequence[int] | None = None,
                   shard_size: int = 64, model_name: str = "", progress: bool = True,
                   features: dict[str, int | None] | None = None) -> str | Path:
    """`extract`'s work over `replicas` engine replicas on the Ray cluster at `address` (`None`:
    the one `ray.init()` finds, `RAY_ADDRESS` or a `ray start` on this machine, else a new one
    here), each `LLM(model, **engine)`. Returns `out`. Raises `ExtractionMismatch` if `out`
    holds an extraction with other settings, and the first error of the replicas
    (`InterventionError` naming the prompt, a bad location) once every unit has run or failed;
    the shards written are kept, and running it again redoes the failed units."""
    import ray
    from tqdm import tqdm

    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    features = dict(features or {})
    store, settings = checked_folder(out, prompts, locations, positions, shard_size, model_name,
                                     features)
    manifest = open_manifest(store, settings)
    done = {shard["index"] for shard in manifest["shards"]}
    units: list[dict[str, Any]] = [
        {"index": index, "first": index * shard_size,
         "prompts": list(prompts[index * shard_size:(index + 1) * shard_size])}
        for index in range(-(-len(prompts) // shard_size)) if index not in done]
    bar = tqdm(total=len(prompts), initial=len(prompts) - sum(len(u["prompts"]) for u in units),
               unit="prompt", disable=not progress, desc="extract")
    sizes = {unit["index"]: len(unit["prompts"]) for unit in units}
    if not units:
        bar.close()
        return out
    fit_ray_socket_paths()
    ray.init(address=address, runtime_env={"env_vars": forwarded_environment()},
             logging_level=logging.WARNING, log_to_driver=False)
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False
        results = ray.data.from_items(units).map_batches(
            Replica, batch_size=1, compute=ray.data.ActorPoolStrategy(size=replicas),
            num_cpus=replica_cpus, num_gpus=replica_gpus,
            fn_constructor_kwargs={"model": model, "engine": engine, "out": store.url,
                                   "locations": list(locations), "positions": positions,
                                   "features": features})
        tokens, started = 0, time.perf_counter()
        failed: list[bytes] = []
        # Every unit is waited for, even after one failed: leaving Ray Data's iteration early
        # can leave threads of its own that touch Ray after `ray.shutdown`, which then ends the
        # process with its own message instead of the run's error.
        for row in results.iter_rows():
            if row["error"]:
                failed.append(row["error"])
                continue
            index = int(row["index"])
            record_shard(store, manifest, index)
            tokens += int(row["tokens"])
            bar.update(sizes[index])
            bar.set_postfix(tokens_per_s=f"{tokens / (time.perf_counter() - started):.0f}")
        if failed:  # the first, as it was raised; the shards written are kept
            raise pickle.loads(failed[0])
    finally:
        bar.close()
        ray.shutdown()
    return out


def fit_ray_socket_paths() -> None:
    """Point a Ray cluster this process starts at `/tmp` (`RAY_TMPDIR`) when the temporary
    folder Ray would use (`TMPDIR`) makes its socket paths longer than Linux allows: Ray then
    fails to start, or hangs. Test runners (nox, tox) and batch schedulers set such folders. A
    `RAY_TMPDIR` the user set is kept."""
    if "RAY_TMPDIR" in os.environ:
        return
    if len(os.environ.get("TMPDIR", "/tmp")) + RAY_SOCKET_SUFFIX > SOCKET_PATH_LIMIT:
        os.environ["RAY_TMPDIR"] = "/tmp"


def forwarded_environment() -> dict[str, str]:
    """The driver's variables the replicas get (`FORWARDED_PREFIXES`)."""
    return {name: value for name, value in os.environ.items()
            if name.startswith(FORWARDED_PREFIXES)}
