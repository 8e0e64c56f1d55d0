"""Modules a compiled model calls from inside an opaque custom op, where no tap can work.

A tap is a custom op that Dynamo traces into the graph (`taps`), so it sits between the
captured pieces of a CUDA graph. A module that vLLM calls from inside one of its own opaque
custom ops is never traced: its hooks run while a CUDA graph is captured, are recorded as bare
kernels, and never run again when the graph is replayed. The runtime notices (the program fails
with `runtime.never_ran`), but a tap there can never be served, so it is refused at start-up.

Only a compiled engine is concerned (an eager one runs every module's Python at every
forward). vLLM's fused mixture-of-experts runner is such a caller on a GPU: its forward enters
`torch.ops.vllm.moe_forward` (or `moe_forward_shared`), inside which it applies the router gate
it holds (Qwen3-MoE, DeepSeek-V2 in vLLM 0.33: a tap at their `router_logits` never runs
there). On the CPU the same runner calls the op's Python directly, which Dynamo
traces, so taps there work. The runner says which it does in `_forward_entry` (vLLM 0.32 and
0.33).
"""

from __future__ import annotations

import torch
from torch import nn

#: The attributes of vLLM's MoE runner that hold what it calls inside its op, besides its own
#: submodules (in case one is held without being registered as one).
HELD_INSIDE = ("gate", "shared_expert_gate", "_shared_experts", "shared_experts")
#: Its submodules it calls in its own forward, outside the op (vLLM 0.32/0.33's latent MoE).
CALLED_OUTSIDE = ("routed_input_transform", "routed_output_transform")


def called_inside_opaque_ops(model: nn.Module) -> dict[int, str]:
    """`id(module)` → the op's name, for every module `model` calls only from inside an opaque
    custom op (the caller itself, which enters the op, is not among them)."""
    found: dict[int, str] = {}
    for caller in model.modules():
        entry = getattr(caller, "_forward_entry", None)
        if not isinstance(entry, torch._ops.OpOverloadPacket | torch._ops.OpOverload):
            continue
        name = str(entry)
        outside = {id(module) for attribute in CALLED_OUTSIDE
                   if isinstance(held := getattr(caller, attribute, None), nn.Module)
                   for module in held.modules()}
        inner = [*caller.children(), *(getattr(caller, attribute, None)
                                       for attribute in HELD_INSIDE)]
        for child in inner:
            if isinstance(child, nn.Module):
                for module in child.modules():
                    if id(module) not in outside:
                        found.setdefault(id(module), name)
    return found


def opaque_reason(location: str, op_name: str) -> str:
    """Why a tap at `location` is refused: its module runs inside `op_name`."""
    return (f"{location} is computed inside vLLM's opaque custom op {op_name}, which the "
            "compiler does not trace into: no tap can serve it on this engine (a CUDA graph "
            "would replay its kernels without the tap's Python). Leave it out of taps=: a "
            "program there still runs, on steps run uncompiled")
