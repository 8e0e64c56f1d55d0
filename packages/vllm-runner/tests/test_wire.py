"""Collected saves cross processes as plain data: through vLLM's own msgpack transport (engine
core to client) and pickle (worker to engine core) every tensor comes back equal, with its dtype
and shape, in writable memory of its own."""

from __future__ import annotations

import pickle

import pytest
import torch
from vllm.v1.engine import EngineCoreOutputs, UtilityOutput
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder, UtilityResult
from vllm_runner import wire


def collected() -> wire.Collected:
    return {"a": {"error": None,
                  "saved": {"layers.0.layer_output": torch.randn(1, 7, 5),
                            "layers.0.mlp_neurons": torch.randn(1, 7, 9).bfloat16(),
                            "next_token_ids": torch.arange(3).reshape(1, 3),
                            "strided": torch.randn(5, 7).t().unsqueeze(0),
                            "empty": torch.empty(1, 0, 4)}},
            "b": {"error": "save at layers.9: no such layer", "saved": {}}}


def through_vllm(data: wire.Collected) -> wire.Collected:
    """What the client receives of a `collective_rpc` result (vLLM's encoder and decoder)."""
    outputs = EngineCoreOutputs(
        utility_output=UtilityOutput(call_id=1, result=UtilityResult(data)))
    frames = [bytes(frame) for frame in MsgpackEncoder().encode(outputs)]
    return MsgpackDecoder(EngineCoreOutputs).decode(frames).utility_output.result.result


def through_vllm_typed(data: wire.Collected) -> wire.Collected:
    """The same with `VLLM_ALLOW_INSECURE_SERIALIZATION`, where vLLM converts every leaf of a
    result to the type it was sent as."""
    import vllm.envs

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vllm.envs, "VLLM_ALLOW_INSECURE_SERIALIZATION", True, raising=False)
        return through_vllm(data)


@pytest.mark.parametrize("transport", [through_vllm, through_vllm_typed,
                                       lambda d: pickle.loads(pickle.dumps(d))])
def test_saves_cross_unchanged(transport) -> None:
    sent = collected()
    received = wire.decode(transport(wire.encode(sent)))
    assert received.keys() == sent.keys()
    for key, result in sent.items():
        assert received[key]["error"] == result["error"]
        assert received[key]["saved"].keys() == result["saved"].keys()
        for location, tensor in result["saved"].items():
            got = received[key]["saved"][location]
            assert got.dtype == tensor.dtype and got.shape == tensor.shape, location
            assert torch.equal(got, tensor), location
            got.add_(1)  # writable, and its own: the sent tensor does not change
            assert not torch.equal(got, tensor) or got.numel() == 0


def test_an_unknown_dtype_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'float7'"):
        wire.decode({"a": {"error": None, "saved": {"x": ["float7", [1], b"\0"]}}})
