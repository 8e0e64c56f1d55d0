"""The last step's requests with programs, reused by a step that schedules the same requests.

A run of decode steps schedules the same requests in the same order step after step. Finding each
one's program again (its `extra_args`, the runtime's checks, a `ScheduledRequest` each) is a large
share of the host work of a step whose programs run inside the graph, where the engine waits on the
host (docs/cuda-graphs-design.md). The next step reuses the list when it schedules the same
requests, in the same order, each with the very object the adapter keeps for it (V1's request state,
V2's kept program, or `None` for a request without one), and no program has failed since the list
was made (a failed program is left out of it, so a failure makes the list stale). The rows change
from step to step and are not part of what is reused: the adapters build the layout anew.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from vllm_runner.ops.wants import ScheduledRequest

if TYPE_CHECKING:
    from vllm_runner.runtime.door import StepDoor


class RepeatedSchedule:
    """One adapter's last scheduled list and what it was made from."""

    def __init__(self) -> None:
        self._request_ids: list[str] = []
        # The adapter's objects themselves are kept, so their ids cannot be reused while compared.
        self._kept: list[object] = []
        self._kept_ids: list[int] = []
        self._scheduled: list[ScheduledRequest] = []
        self._edits = False

    def requests(self, runtime: StepDoor, request_ids: Sequence[str], kept: list[object],
                 find: Callable[[], list[ScheduledRequest]]) -> list[ScheduledRequest]:
        """This step's requests with programs: the last step's list if this step schedules the
        same `request_ids` (in order), each with the same `kept` object, and no program has
        failed; else what `find` makes request by request, remembered for the next step. A
        reused list whose programs edit marks the step as editing, as `StepDoor.program` would
        have."""
        if (not runtime.any_failed and [id(item) for item in kept] == self._kept_ids
                and list(request_ids) == self._request_ids):
            if self._edits:
                runtime.note_edits()
            return self._scheduled
        scheduled = find()
        self._request_ids, self._kept, self._scheduled = list(request_ids), kept, scheduled
        self._kept_ids = [id(item) for item in kept]
        self._edits = any(request.program.edits for request in scheduled)
        return scheduled
