"""`SamplingParams(n > 1)` with interventions: one engine request per sample, merged back.

vLLM runs `n > 1` by fanning a request out into `n` child requests inside the engine, which all
share the parent's `SamplingParams.extra_args` — so one program, and one set of saves, for `n`
different sequences. Instead, `LLM.generate` sends each sample as a request of its own, with
`n=1` and its own program (the same ops), and seeds them as vLLM seeds its children (`seed + j`
for sample `j`, when a seed is given). The outputs are then merged back into the shape vLLM
returns for `n > 1`: one `RequestOutput` per prompt, whose `outputs[j]` is sample `j`.

Each sample's saves are on its completion, `outputs[i].outputs[j].saved` (and `.error`), laid
out exactly as a single sample's: the prompt's rows — equal for every sample, since each sees
the same prompt and the same edits — then that sample's generated rows. So code written for one
sample works on each. `outputs[i].saved` and `outputs[i].error` are sample 0's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm import SamplingParams

# `LLM.generate` keywords that vLLM takes as one value per prompt when given as a list.
PER_PROMPT_KEYWORDS = ("lora_request", "priority")


@dataclass(frozen=True)
class Fanned:
    """Where each prompt's engine requests sit in the expanded list: `starts[i]` is prompt i's
    first request, `counts[i]` how many it has (its samples, or 1)."""

    starts: list[int]
    counts: list[int]

    @property
    def expanded(self) -> bool:
        """Whether any prompt was sent as more than one request."""
        return any(count > 1 for count in self.counts)


def sample_params(given: SamplingParams, samples: int) -> list[SamplingParams]:
    """The `SamplingParams` of each of a prompt's `samples` requests (a copy each: the caller's
    object is not changed), seeded as vLLM seeds the children of an `n > 1` request."""
    if samples == 1:
        return [given.clone()]
    found = []
    for index in range(samples):
        params = given.clone()
        params.n = 1
        if given.seed is not None:
            params.seed = given.seed + index
        found.append(params)
    return found


def fan_keywords(kwargs: dict[str, Any], fanned: Fanned) -> dict[str, Any]:
    """`generate`'s keywords with each per-prompt list repeated for every request of its
    prompt, so that it still lines up with the requests."""
    if not fanned.expanded:
        return kwargs
    found = dict(kwargs)
    for name in PER_PROMPT_KEYWORDS:
        value = kwargs.get(name)
        if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            if len(value) != len(fanned.counts):
                raise ValueError(f"{name}= has {len(value)} entries for {len(fanned.counts)} "
                                 "prompts; pass one per prompt, or one for all")
            found[name] = [item for item, count in zip(value, fanned.counts, strict=True)
                           for _ in range(count)]
    return found


def merge(outputs: list[Any], fanned: Fanned) -> list[Any]:
    """One output per prompt: a prompt sent as several requests becomes its first request's
    output holding every sample's completion, numbered as vLLM numbers them. Outputs of
    requests not in this call (vLLM returns requests queued before it) come first, as vLLM
    returns them."""
    earlier = len(outputs) - sum(fanned.counts)
    merged = list(outputs[:earlier])
    for start, count in zip(fanned.starts, fanned.counts, strict=True):
        group = outputs[earlier + start: earlier + start + count]
        first = group[0]
        if count > 1:
            completions = []
            for index, output in enumerate(group):
                (completion,) = output.outputs
                completion.index = index
                completions.append(completion)
            first.outputs = completions
            first.finished = all(output.finished for output in group)
        merged.append(first)
    return merged


def label_completions(outputs: list[Any]) -> None:
    """Give every completion its request's saves and error (`outputs[i].outputs[j].saved`), so
    that n = 1 and n > 1 read alike; called on the engine's outputs before `merge`."""
    for output in outputs:
        for completion in output.outputs:
            completion.saved, completion.error = output.saved, output.error
