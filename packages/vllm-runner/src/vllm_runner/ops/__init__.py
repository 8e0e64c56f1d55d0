"""Operations a request's program runs on its own rows: what users put in `interventions`.

Each op is a small value object. The client turns it into plain data (`to_data`) that travels
in `SamplingParams.extra_args`; a worker turns the data back into the same class
(`op_from_data`) and the op does its own work there: where it acts (`patterns`), how many
requests running it are served together (`serve_group`), how it saves or edits (`serve`,
`edited`), what it leaves in the saves (`saved_names`), what its tensor must fit
(`tensor_misfit`) and how many bytes it keeps (`saved_bytes`). A new op is one class — in
`reads` (ops that save what they read), `edits` (ops that change values), `call` (the user's
own code) or `features` (in an SAE's feature space), on the bases of `base` — plus its tests and
its line in the JSON schema.
"""

from __future__ import annotations

from typing import Any

from vllm_runner.ops.base import GroupServer as GroupServer
from vllm_runner.ops.base import Op
from vllm_runner.ops.base import PositionFilter as PositionFilter
from vllm_runner.ops.base import RowOp as RowOp
from vllm_runner.ops.call import Call, CallContext
from vllm_runner.ops.checks import STEPS, Steps
from vllm_runner.ops.data import TAG, field_from_data, tensor_from_data, tensor_to_data
from vllm_runner.ops.edits import Add, ProjectOut, Scale, Set, Skip, Zero
from vllm_runner.ops.edits import EditOp as EditOp
from vllm_runner.ops.edits import with_rows_kept as with_rows_kept
from vllm_runner.ops.features import ClampFeatures, Features, SteerFeatures
from vllm_runner.ops.reads import Lens, Probe, Save

# `tensor_to_data`/`tensor_from_data` were defined here before `ops.data`; kept importable.
__all__ = [
    "STEPS",
    "Add",
    "Call",
    "CallContext",
    "ClampFeatures",
    "Features",
    "Lens",
    "Op",
    "Probe",
    "ProjectOut",
    "Save",
    "Scale",
    "Set",
    "Skip",
    "SteerFeatures",
    "Steps",
    "Zero",
    "op_from_data",
    "tensor_from_data",
    "tensor_to_data",
]


OPS_BY_KIND: dict[str, type[Op]] = {
    op.kind: op for op in (Save, Add, Set, Scale, Zero, ProjectOut, Skip, Call, Lens, Probe,
                           Features, SteerFeatures, ClampFeatures)}


def op_from_data(data: dict[str, Any]) -> Op:
    """The op `Op.to_data` made `data` from, checked again as when the user made it."""
    kind = data.get(TAG)
    op_class = OPS_BY_KIND.get(kind) if isinstance(kind, str) else None
    if op_class is None:
        raise ValueError(f"unknown op {kind!r}: the ops are {', '.join(OPS_BY_KIND)}")
    fields = {name: field_from_data(value) for name, value in data.items() if name != TAG}
    return op_class(**op_class.fields_from_data(fields))
