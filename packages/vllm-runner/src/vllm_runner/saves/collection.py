"""What a client asks the workers to collect (`Finished`: a finished request and how many of its
positions belong to its final output) and what comes back (`Collected`: its saves and its
error), the protocol between `client`/`server` and the worker's `runtime`."""

from __future__ import annotations

from typing import TypedDict

import torch


class Finished(TypedDict):
    """A finished request to collect: how many positions belong to its final output (prompt
    plus generated tokens but the last) and its prompt's length."""

    program_id: str
    computed: int
    prompt_length: int


def finished_request(program_id: str, prompt_length: int, generated: int) -> Finished:
    """A request that ended with `generated` tokens after a prompt of `prompt_length`: the last
    generated token was sampled but never run through the model, so it has no saved row."""
    return {"program_id": program_id, "computed": prompt_length + max(generated - 1, 0),
            "prompt_length": prompt_length}


class Collected(TypedDict):
    """A finished request's saves (canonical location → host tensor) and why its program
    failed, if it did."""

    saved: dict[str, torch.Tensor]
    error: str | None
