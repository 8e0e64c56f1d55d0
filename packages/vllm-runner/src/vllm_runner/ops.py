"""Operations a request's program runs on its own rows: what users put in `interventions`.

Each op is a small value object that turns itself into plain data (`to_data`), so a program can
travel in `SamplingParams.extra_args` across process boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Steps = Literal["all", "prefill", "decode"]


@dataclass(frozen=True)
class Save:
    """Save the value at `location` for this request, at every position it runs through.

    `outputs[i].saved[location]` is then a CPU tensor in the value's layout with the token axis
    covering the prompt and each generated token but the last, in position order. `positions`
    (absolute, or negative from the end of the prompt) keeps only those positions; `steps`
    keeps only prefill or decode steps.
    """

    location: str
    positions: tuple[int, ...] | None = None
    steps: Steps = "all"

    def to_data(self) -> dict[str, Any]:
        """Plain data for `SamplingParams.extra_args`."""
        return {"op": "save", "location": self.location,
                "positions": None if self.positions is None else list(self.positions),
                "steps": self.steps}


Op = Save
