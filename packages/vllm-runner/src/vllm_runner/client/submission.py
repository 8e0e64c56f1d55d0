"""One program on its way into the engine and its saves on their way back: the piece `LLM`,
`AsyncLLM` and the server (`server.requests.Plan`) share.

A program is encoded once (tensors as bytes, `Call` functions pickled, its digest), however many
engine requests run it; each engine request made from it gets a program id of its own in its
`SamplingParams` (`attach`) and the program's prefix-cache salt on its prompt (`salt`). When
they finish, the workers are asked for their saves in one call (`client.collection`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Self

from vllm import SamplingParams

from vllm_runner.ops import Op
from vllm_runner.ops.program import attach_program, encode_ops, program_digest, salted
from vllm_runner.saves.collection import Finished, finished_request


@dataclass
class Submission:
    """One program, encoded once, and the program id of each engine request made from it (in
    the order they were attached)."""

    ops_data: list[dict[str, Any]]
    digest: str
    program_ids: list[str] = field(default_factory=list)
    #: The ops as given (what the server's checks read).
    ops: list[Op] = field(default_factory=list)

    @classmethod
    def of(cls, ops: Sequence[Op], **fields: Any) -> Self:
        """`ops` encoded, with no engine request yet (`fields`: a subclass's own)."""
        data = encode_ops(ops)
        return cls(data, program_digest(data), ops=list(ops), **fields)

    def attach(self, params: SamplingParams) -> str:
        """Give one engine request's `SamplingParams` a program of its own (kept off cached
        prompt blocks: the program must see every prompt row); returns its program id."""
        program_id = attach_program(params, self.ops_data, self.digest)
        self.program_ids.append(program_id)
        return program_id

    def salt(self, given_salt: str | None) -> str:
        """The prompt's `cache_salt`: its KV blocks are shared only with requests running this
        very program (a salt the caller gave keeps its meaning too)."""
        return salted(given_salt, self.digest)

    def finished(self, prompt_lengths: Sequence[int], generated: Sequence[int]
                 ) -> list[Finished]:
        """Each engine request, in attach order, as the workers collect it: its prompt's
        tokens and its generated tokens."""
        return [finished_request(program_id, prompt_length, count) for program_id,
                prompt_length, count in zip(self.program_ids, prompt_lengths, generated,
                                            strict=True)]
