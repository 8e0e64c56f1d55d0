"""GPT-2 family: vLLM's `GPT2LMHeadModel` (models/gpt2.py, checked against vLLM 0.32).

Blocks take and return the whole stream, the MLP is plain (`c_fc` → GELU → `c_proj`), positions
are learned (`wpe`, added after `token_embeddings`), and the modules keep GPT-2's own names."""

from vllm_envoys.family import Family
from vllm_envoys.hosts import PlainMlp, StreamLayer


class Gpt2Mlp(PlainMlp):
    """`c_fc` → `act` → `c_proj`."""

    down_name = "c_proj"


class Gpt2Layer(StreamLayer):
    """`ln_1` → `attn` → add → `ln_2` → `mlp` → add."""

    Mlp = Gpt2Mlp
    attention_name = "attn"
    mid_norm_name = "ln_2"


class Gpt2(Family):
    """GPT-2 names and stream-in/stream-out blocks."""

    model_types = ("gpt2",)
    embed_tokens = "transformer.wte"
    layers = "transformer.h"
    norm = "transformer.ln_f"
    Layer = Gpt2Layer
