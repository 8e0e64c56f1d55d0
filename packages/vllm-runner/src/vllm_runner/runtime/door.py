"""The one door between an engine adapter and the worker's runtime: what `engine/` asks and
tells, and nothing more.

An adapter (one per vLLM model runner, in `engine/`) reads vLLM's private state and drives the
runtime through `StepDoor` at each step: which requests run a program and whether they act now,
which CUDA graph the step may run (asked once: `graph_need`), then the step's begin and end.
The worker's RPCs (`engine.worker`) reach the runtime through `WorkerDoor`: resolving
locations, collecting finished requests' saves, dropping programs. `Runtime` is the one
implementation; supporting another vLLM release changes an adapter, not this door.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Protocol

from tokenspan import StepLayout

from vllm_runner.ops.program import Program, ProgramData
from vllm_runner.ops.wants import ScheduledRequest
from vllm_runner.saves.collection import Collected, Finished
from vllm_runner.saves.store import Places


class GraphNeed(enum.Enum):
    """What a compiled step's programs need of its CUDA graph (`StepDoor.graph_need`)."""

    #: The graph serves them all (or inside the graph: `compiled.in_graph`): the engine's own
    #: choice stands.
    ANY = "any"
    #: A tap's Python runs: no full CUDA graph (a full graph replays the taps' kernels without
    #: their Python), but piecewise graphs, or a full graph broken at the taps.
    PIECES = "pieces"
    #: One acts where no tap serves (or reads the step's token ids): the plain module tree.
    MODULE_TREE = "module_tree"


class StepDoor(Protocol):
    """What an engine adapter drives at each step."""

    @property
    def compiled(self) -> bool:
        """Whether the engine runs vLLM's compiled model (taps serve values there)."""

    @property
    def taps(self) -> frozenset[str]:
        """The locations served from inside the compiled model."""

    @property
    def every_program_acts(self) -> bool:
        """Whether every program acts at every step, so no request need be asked (`acts_at`)."""

    @property
    def any_failed(self) -> bool:
        """Whether any program has failed since the engine started."""

    def program(self, data: ProgramData, prompt_length: int) -> Program | None:
        """A scheduled request's program (decoded once), or `None` once it has failed."""

    def acts_at(self, data: ProgramData, prompt_length: int, first_position: int) -> bool:
        """Whether a request running `data` may act at a step whose rows start at
        `first_position`."""

    def edits(self, data: ProgramData) -> bool:
        """Whether a program may change the engine's values (its KV blocks are zeroed before
        reuse)."""

    def note_edits(self) -> None:
        """Mark this step as running an editing program found at an earlier step."""

    def graph_need(self, data: Sequence[ProgramData]) -> GraphNeed:
        """What a compiled step running the programs `data` needs of its CUDA graph."""

    def needs_module_tree(self, programs: Sequence[Program]) -> bool:
        """Whether a step running the decoded `programs` must run the plain module tree."""

    def begin_step(self, layout: StepLayout, requests: Sequence[ScheduledRequest],
                   compiled_forward: bool = False) -> None:
        """Plan the step's rows and hook what its programs want; `compiled_forward`: whether
        the forward runs vLLM's compiled path (counted in `forwards`)."""

    def count_tap_break(self, joined: bool) -> None:
        """Count a forward that replayed a full CUDA graph broken at the taps."""

    def locations_waited_at(self) -> list[str]:
        """The taps this step's programs wait at (a graph broken at the taps stops there)."""

    def end_step(self) -> None:
        """Fail what waited at a hook that never ran, and forget the step's token rows."""


class WorkerDoor(Protocol):
    """What the worker's RPCs ask of the runtime (`engine.worker`)."""

    refused_taps: dict[str, str]
    forwards: dict[str, int]

    @property
    def taps(self) -> frozenset[str]:
        """The locations served from inside the compiled model."""

    def resolve(self, pattern: str) -> list[str]:
        """The canonical locations a pattern names."""

    def saes(self) -> dict[str, Any]:
        """The SAEs loaded (`"loaded"`, each as plain data) and those refused, with the reasons
        (`"refused"`)."""

    def load_saes(self, paths: dict[str, Any]) -> dict[str, Any]:
        """Load more SAEs (name -> path and site: `settings.saes_config`); `saes()` after."""

    def edit_refusal(self, location: str) -> str | None:
        """Why a value cannot be edited, or `None`."""

    def support(self) -> dict[str, str | None]:
        """Every value of the model → `None` if available, else the reason."""

    def layouts(self) -> dict[str, list[str]]:
        """Every available value's axis names, by location."""

    def collect(self, finished: Sequence[Finished], into: Places | None = None
                ) -> dict[str, Collected]:
        """The saves and errors of finished requests, freed here."""

    def drop(self, program_ids: Sequence[str]) -> None:
        """Forget programs whose requests ended without being collected."""

    def saves_held(self) -> dict[str, int]:
        """What the store holds now, by program (for leak checks)."""


class EngineDoor(StepDoor, WorkerDoor, Protocol):
    """The runtime as an engine's model runner holds it (`runner.interp`): both doors."""
