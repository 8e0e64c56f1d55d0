"""Checks of an op against the engine it is sent to (its vocabulary, its longest request), made
by the client before a request is queued: by `LLM.generate` and by the server alike."""

from __future__ import annotations

from vllm_runner.ops import Lens, Op
from vllm_runner.ops.checks import listed


def check_op_fits(op: Op, vocab_size: int, max_model_len: int) -> None:
    """Refuse (`ValueError`, naming the op and the fix) what no request of this engine could
    ever serve: a lens wider than the vocabulary, token ids outside it, positions past
    `max_model_len`."""
    if isinstance(op, Lens) and op.top_k > vocab_size:
        raise ValueError(f"Lens({op.location!r}, top_k={op.top_k}): the vocabulary has "
                         f"{vocab_size} tokens; choose top_k <= {vocab_size}")
    unknown = [t for t in getattr(op, "tokens", None) or () if t >= vocab_size]
    if unknown:
        raise ValueError(f"{type(op).__name__}({op.location!r}): tokens {listed(unknown)} are "
                         f"not in the vocabulary (ids 0..{vocab_size - 1}); no position can "
                         "hold them")
    never = [p for p in getattr(op, "positions", None) or ()
             if p >= max_model_len or p < -max_model_len]
    if never:
        raise ValueError(f"{type(op).__name__}({op.location!r}): positions {listed(never)} "
                         f"can never exist: requests hold at most max_model_len={max_model_len} "
                         f"positions (0..{max_model_len - 1}, or -1..-{max_model_len} from the "
                         "end of the prompt)")
