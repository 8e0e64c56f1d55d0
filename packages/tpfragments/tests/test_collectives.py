"""Every rule and layout, with real collectives: gloo on CPU, groups of 2 and 4 processes.

One process group is spawned per world size (spawning costs seconds per process here) and runs
the whole battery in `rank_checks.py`; each test below asserts one check's outcome on every rank.
"""

from __future__ import annotations

import pytest
import rank_checks
from tpf_ranks import run_ranks

WORLD_SIZES = (2, 4)
CASES = [case.name for case in rank_checks.cases(2)]
CHECKS = [*CASES, "errors-before-collectives", "edges"]


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda size: f"world{size}")
def world(request: pytest.FixtureRequest) -> tuple[int, list[dict]]:
    size = request.param
    return size, run_ranks(size, rank_checks.battery)


def _outcomes(world: tuple[int, list[dict]], check: str) -> list[dict]:
    size, reports = world
    outcomes = [report[check] for report in reports]
    failures = [f"rank {rank}:\n{outcome['error']}" for rank, outcome in enumerate(outcomes)
                if not outcome["ok"]]
    assert not failures, f"{check} failed at world size {size}:\n" + "\n".join(failures)
    return outcomes


def test_battery_covers_every_case(world: tuple[int, list[dict]]) -> None:
    size, reports = world
    assert len(reports) == size
    for report in reports:
        assert sorted(report) == sorted(CHECKS)


@pytest.mark.parametrize("check", CASES)
def test_rule_is_exact_with_one_collective_per_visit(world: tuple[int, list[dict]],
                                                     check: str) -> None:
    outcomes = _outcomes(world, check)
    expected = next(case for case in rank_checks.cases(world[0]) if case.name == check)
    for outcome in outcomes:
        # Each of the four visits gathers at most once; handing back never communicates.
        assert outcome["visits"] == [expected.expected_collectives] * 3
        assert outcome["back_collectives"] == 0
    # The same collectives, in the same number, on every rank.
    assert len({tuple(sorted(outcome["total"].items())) for outcome in outcomes}) == 1
    assert sum(outcomes[0]["total"].values()) == 4 * expected.expected_collectives


def test_bad_input_is_refused_before_any_collective(world: tuple[int, list[dict]]) -> None:
    outcomes = _outcomes(world, "errors-before-collectives")
    # Only the final, valid gather ran.
    assert all(outcome["total"] == {"all_gather": 1} for outcome in outcomes)


def test_empty_steps_and_scalars(world: tuple[int, list[dict]]) -> None:
    _outcomes(world, "edges")
