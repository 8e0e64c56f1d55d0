"""The server's request types (vLLM's, with `interventions`) and each request's program."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, PrivateAttr
from vllm import SamplingParams
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

from vllm_runner.client.submission import Submission


@dataclass
class Plan(Submission):
    """One HTTP request's program (`Submission`: encoded once; each engine request made from it,
    one per prompt, gets its own program id, in prompt order), with what the server's checks
    and its answer need."""

    #: The locations each op acts at (what the saved-bytes bound reads).
    locations: list[list[str]] = field(default_factory=list)
    #: How the saves come back: "inline" in the response, "id" kept for `GET
    #: /v1/interp/saves/{id}`, "auto" by size (`--interp-inline-mib`).
    saves: str = "auto"


class WithInterventions(BaseModel):
    """The fields a request gains (`interventions`, `interp_saves`), and its program attached
    to each engine request vLLM makes from it (one per prompt)."""

    interventions: Any = None  # checked by json_ops, whose errors say what to send
    interp_saves: Any = "auto"
    _interp: Plan | None = PrivateAttr(default=None)

    def to_sampling_params(self, *args: Any, **kwargs: Any) -> SamplingParams:
        """vLLM's, with this request's program attached."""
        params = super().to_sampling_params(*args, **kwargs)  # type: ignore[misc]
        if self._interp is not None:
            self._interp.attach(params)
        return params


class InterpCompletionRequest(WithInterventions, CompletionRequest):
    """vLLM's completion request with `interventions`."""


class InterpChatCompletionRequest(WithInterventions, ChatCompletionRequest):
    """vLLM's chat completion request with `interventions`."""
