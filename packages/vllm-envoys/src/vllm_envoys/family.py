"""`Family`: how one architecture's vLLM model maps onto the standard hosts.

A family module is short and declarative: a subclass of `Family` naming the `model_type`s it
covers, where the embeddings, layers and final norm sit, and which host classes its blocks use.
Everything not overridden is vLLM's common shape (Llama's).
"""

from __future__ import annotations

from typing import ClassVar

from vllm_envoys.hosts import FusedLayer, Layer, Model


class Family:
    """The defaults, which are vLLM's Llama layout; subclass and override what differs."""

    model_types: ClassVar[tuple[str, ...]] = ()
    # "vllm" for vLLM's own model code; "transformers" for models vLLM runs through its
    # Transformers backend (transformers' modules, vLLM's attention and parallel layers).
    backend: ClassVar[str] = "vllm"
    embed_tokens: ClassVar[str] = "model.embed_tokens"
    layers: ClassVar[str] = "model.layers"
    norm: ClassVar[str] = "model.norm"
    lm_head: ClassVar[str] = "lm_head"
    Layer: ClassVar[type[Layer]] = FusedLayer
    Model: ClassVar[type[Model]] = Model
    # Whether the family's MLPs (some or all) are mixtures of experts; for the docs' table only:
    # at run time each layer picks its host from its MLP module.
    mixture_of_experts: ClassVar[bool] = False
