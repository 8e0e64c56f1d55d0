"""Axis names of every standard value, in nnterp's layouts (with the leading batch axis of 1).

A layout is documentation that tests check: each value read has one axis per name, and the
sizes follow from the model's config (`hidden`, `heads`, `head_dim`, ...) and the request's
token count.
"""

from __future__ import annotations

Layout = tuple[str, ...]

RESIDUAL: Layout = ("batch", "tokens", "hidden")
NEURONS: Layout = ("batch", "tokens", "intermediate")
QUERIES: Layout = ("batch", "heads", "tokens", "head_dim")
KEYS: Layout = ("batch", "kv_heads", "tokens", "head_dim")
VALUES: Layout = ("batch", "kv_heads", "tokens", "head_dim")
HEAD_OUTPUTS: Layout = ("batch", "tokens", "heads", "head_dim")
PATTERN: Layout = ("batch", "heads", "query", "key")
ROUTER_LOGITS: Layout = ("batch", "tokens", "experts")
EXPERT_WEIGHTS: Layout = ("batch", "tokens", "top_k")
EXPERT_INDICES: Layout = ("batch", "tokens", "top_k")
LOGITS: Layout = ("batch", "tokens", "vocab")  # tokens: the rows sampled this step
