"""Cohere family (Command R, Command R7B): vLLM's `CohereForCausalLM` (models/commandr.py, checked
against vLLM 0.32).

A parallel block: attention and the MLP both read the same normed input and their outputs are
added to the stream together, so there is no stream between them (`layer_mid` is unavailable).
Blocks take the whole stream as `hidden_states` and return `(stream, block input)`; the second
item is not part of the stream (the next block ignores it). Logits are scaled by `logit_scale`,
as sampled."""

from vllm_envoys import layouts
from vllm_envoys.codecs import Rows
from vllm_envoys.eproperty import EProperty, unavailable
from vllm_envoys.family import Family
from vllm_envoys.hosts import StreamLayer
from vllm_envoys.sites import Output

PARALLEL = (
    "attention and the MLP run in parallel on the same normed input, so no stream exists between "
    "them; layer_input + attention_output is the stream as if only attention had run"
)


class CohereLayer(StreamLayer):
    """`input_layernorm` → attention and MLP side by side → one add; returns `(stream, input)`."""

    layer_mid = unavailable(PARALLEL, layouts.RESIDUAL)
    layer_output = EProperty(Output(0), Rows(), layouts.RESIDUAL,
                             "the residual stream leaving the block")


class Cohere(Family):
    """Parallel attention and MLP blocks."""

    model_types = ("cohere", "cohere2")
    Layer = CohereLayer
