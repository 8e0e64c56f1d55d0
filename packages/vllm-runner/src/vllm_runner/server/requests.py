"""The server's request types (vLLM's, with `interventions`) and each request's program."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, PrivateAttr
from vllm import SamplingParams
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

from vllm_runner.ops import Op
from vllm_runner.ops.program import attach_program


@dataclass
class Plan:
    """One request's program, encoded once; each engine request made from it (one per prompt)
    gets its own program id, in prompt order."""

    ops_data: list[dict[str, Any]]
    digest: str
    program_ids: list[str] = field(default_factory=list)
    #: The ops decoded, and the locations each acts at (what the saved-bytes bound reads).
    ops: list[Op] = field(default_factory=list)
    locations: list[list[str]] = field(default_factory=list)
    #: How the saves come back: "inline" in the response, "id" kept for `GET
    #: /v1/interp/saves/{id}`, "auto" by size (`--interp-inline-mib`).
    saves: str = "auto"

    def attach(self, params: SamplingParams) -> SamplingParams:
        """Give one engine request's sampling parameters a program of their own, and keep it
        off cached prompt blocks (the program must see every prompt row)."""
        self.program_ids.append(attach_program(params, self.ops_data, self.digest))
        return params


class WithInterventions(BaseModel):
    """The fields a request gains (`interventions`, `interp_saves`), and its program attached
    to each engine request vLLM makes from it (one per prompt)."""

    interventions: Any = None  # checked by json_ops, whose errors say what to send
    interp_saves: Any = "auto"
    _interp: Plan | None = PrivateAttr(default=None)

    def to_sampling_params(self, *args: Any, **kwargs: Any) -> SamplingParams:
        """vLLM's, with this request's program attached."""
        params = super().to_sampling_params(*args, **kwargs)  # type: ignore[misc]
        return params if self._interp is None else self._interp.attach(params)


class InterpCompletionRequest(WithInterventions, CompletionRequest):
    """vLLM's completion request with `interventions`."""


class InterpChatCompletionRequest(WithInterventions, ChatCompletionRequest):
    """vLLM's chat completion request with `interventions`."""
