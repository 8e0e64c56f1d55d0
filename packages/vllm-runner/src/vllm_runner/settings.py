"""Engine-wide settings that must reach the worker processes.

vLLM starts its workers in processes of their own (engine core, tensor-parallel ranks), which
inherit the client's environment when they start and nothing the client sets later. A setting
for the workers is therefore an environment variable, set before the engine starts.
"""

from __future__ import annotations

import os

from tokenspan import READ_MODES, ReadMode

#: How values are lent to `Call` functions unless an op says otherwise (see `ops.Call`).
READS_VARIABLE = "VLLM_INTERP_READS"


def read_mode(value: str | None = None) -> ReadMode:
    """`value`, or the `VLLM_INTERP_READS` setting, or `"lease"`; refused if not a read mode."""
    mode = value if value is not None else os.environ.get(READS_VARIABLE, "lease")
    if mode not in READ_MODES:
        raise ValueError(f"read mode {mode!r} (LLM(interp_reads=) or {READS_VARIABLE}) must be "
                         f"one of {', '.join(READ_MODES)}")
    return mode
