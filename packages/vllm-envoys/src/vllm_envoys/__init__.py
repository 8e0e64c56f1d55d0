"""vllm-envoys: nnterp's standard values on vLLM's own model code.

`standardize(model, hf_config)` maps a vLLM model onto nnterp's names (`layers[i]`,
`self_attn`, `mlp`) and values (`layer_output`, `attention_queries`, `mlp_neurons`, ...), each
a `Value` that says which module to hook, how to read one request's raw rows into the standard
layout (a private copy) and how to write an edited value back. It installs no hooks: that is
the runner's job (vllm-runner).
"""

from importlib.metadata import PackageNotFoundError, version

from vllm_envoys.codecs import Codec, Heads, Rows, Scaled, Stream
from vllm_envoys.eproperty import EProperty, Step, Value, unavailable
from vllm_envoys.errors import (
    EnvoyError,
    ReadOnly,
    Unavailable,
    UnknownFamily,
    UnknownValue,
    ValueShapeError,
)
from vllm_envoys.family import Family
from vllm_envoys.hosts import (
    Attention,
    FusedLayer,
    GatedMlp,
    Host,
    Layer,
    Model,
    Moe,
    PlainMlp,
    StreamLayer,
)
from vllm_envoys.sites import Arguments, HookArgs, Output
from vllm_envoys.standardize import Standardized, standardize

try:
    __version__ = version("vllm-envoys")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "Arguments", "Attention", "Codec", "EProperty", "EnvoyError", "Family", "FusedLayer",
    "GatedMlp", "Heads", "HookArgs", "Host", "Layer", "Model", "Moe", "Output", "PlainMlp",
    "ReadOnly", "Rows", "Scaled", "Standardized", "Step", "Stream", "StreamLayer", "Unavailable",
    "UnknownFamily", "UnknownValue", "Value", "ValueShapeError", "__version__", "standardize",
    "unavailable",
]
