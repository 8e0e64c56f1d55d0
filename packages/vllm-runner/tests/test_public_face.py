"""The public face: what `vllm_runner` and `vllm_runner.ops` export is exactly this, and each
name resolves. Everything else (the rooms: `client/`, `engine/`, ...) is internal and may move;
a change here is a change of the API, made on purpose."""

from __future__ import annotations

import vllm_runner
from vllm_runner import ops

PUBLIC = {"LLM", "AsyncLLM", "EngineDied", "EngineStartError", "InterpError",
          "InterventionError", "LocationError", "SAEsRefused", "TapsRefused", "UnsupportedEngine",
          "__version__", "ops"}
OPS = {"Add", "Call", "CallContext", "ClampFeatures", "Features", "Lens", "Op", "Probe",
       "ProjectOut", "Save", "Scale", "Set", "Skip", "SteerFeatures", "Steps", "STEPS", "Zero",
       "op_from_data", "tensor_from_data", "tensor_to_data"}


def test_the_package_exports_exactly_its_public_names() -> None:
    assert set(vllm_runner.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(vllm_runner, name) is not None, name


def test_ops_exports_exactly_the_ops_and_their_plain_data() -> None:
    assert set(ops.__all__) == OPS
    for name in OPS:
        assert getattr(ops, name) is not None, name
    assert all(issubclass(getattr(ops, name), ops.Op)
               for name in ("Add", "Call", "ClampFeatures", "Features", "Lens", "Probe",
                            "ProjectOut", "Save", "Scale", "Set", "Skip", "SteerFeatures", "Zero"))
