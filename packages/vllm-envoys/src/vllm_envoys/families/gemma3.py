"""Gemma 3 family (text): vLLM's `Gemma3ForCausalLM` (models/gemma3.py, checked against vLLM
0.32). Gemma 2's sandwich-norm block, with q and k RMS-normed per head before the rotary
embedding (so queries and keys include the norm) and local sliding-window layers beside global
ones; no attention soft-cap. As in Gemma 2, `token_embeddings` is before the `sqrt(hidden)`
scale."""

from vllm_envoys.families.gemma2 import Gemma2Layer
from vllm_envoys.family import Family


class Gemma3(Family):
    """Gemma 2's layout; the differences live inside attention, before the values."""

    model_types = ("gemma3_text",)
    Layer = Gemma2Layer
