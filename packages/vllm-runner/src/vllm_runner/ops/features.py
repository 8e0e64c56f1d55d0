"""The ops in a sparse autoencoder's feature space, by the name the engine loaded the SAE under
(`LLM(saes={"res12": path})`): read its features (`Features`), steer by its decoder's
directions (`SteerFeatures`), and clamp features with the reconstruction error kept
(`ClampFeatures`).

A client names the SAE, never its weights: each op acts at the pattern `sae:<name>`, which the
workers resolve to the location the SAE reads (one that names no SAE of the engine is refused by
name, before anything runs). A worker then binds the op to its loaded SAE (`bound`): a steer
becomes the `Add` of its summed directions, which every path that serves an `Add` serves
(compiled taps and graph taps included); the others become worker-side ops holding what of the
SAE they need.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from vllm_runner.ops.base import GroupServer, Op, RowOp, SAELookup, SAESizes
from vllm_runner.ops.checks import listed
from vllm_runner.ops.edits import Add, EditOp
from vllm_runner.ops.reads import RowResults

if TYPE_CHECKING:
    from saecodec import SAE

    from vllm_runner.ops.value_shape import ValueShape
    from vllm_runner.runtime.row_serving import Services, Visit

#: How an SAE op names where it acts: `sae:<name>`, resolved by the workers.
SAE_PATTERN_PREFIX = "sae:"


def sae_pattern(name: str) -> str:
    """The location pattern of the SAE loaded as `name`."""
    return f"{SAE_PATTERN_PREFIX}{name}"


def feature_names(sae: str) -> tuple[str, str]:
    """Where an SAE's features are saved: `f"{sae}.features.indices"` and `...values`."""
    return f"{sae}.features.indices", f"{sae}.features.values"


def _check_name(op: SAEOp) -> None:
    if not isinstance(op.sae, str) or not op.sae or any(c.isspace() for c in op.sae):
        raise ValueError(f"{type(op).__name__}(sae={op.sae!r}): give the name an SAE was loaded "
                         "under, e.g. LLM(saes={'res12': '/path/to/sae'}) then sae='res12'")


@dataclass(frozen=True)
class SAEOp(RowOp):
    """An op at an SAE's location, named by the SAE (`sae`); `positions`, `steps` and `tokens`
    as for `Save`. Its `location` is the pattern `sae:<name>` (not an argument)."""

    PATTERN_FIELD = "sae"

    location: str = field(init=False, default="")
    sae: str

    def __post_init__(self) -> None:
        _check_name(self)
        object.__setattr__(self, "location", sae_pattern(self.sae))
        super().__post_init__()

    def data_fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        """Without `location`, which the SAE's name gives."""
        return {name: value for name, value in fields.items() if name != "location"}

    def with_saes(self, lookup: SAELookup) -> Op:
        """Bound to the SAE it names (`bound`)."""
        return self.bound(*lookup(self.sae))

    def bound(self, sae: SAE, location: str) -> Op:
        """This op as the worker runs it at canonical `location`, with the SAE loaded there."""
        raise NotImplementedError(type(self).__name__)


@dataclass(frozen=True)
class Features(SAEOp):
    """Save the SAE's features of each row it keeps: `saved[f"{sae}.features.indices"]`
    (int64) and `saved[f"{sae}.features.values"]`, each `[1, positions, top_k]`, the largest
    first; a slot with no active feature has index -1 and value 0. Only these leave the
    worker. `top_k=None` keeps every active feature: a TopK SAE's `k`; for an SAE whose
    features per token have no bound (standard, JumpReLU), as many as the request's busiest
    token has (`[1, positions, most active]`), which costs more: each request is encoded
    alone, and the worker waits for the device to count them at every step."""

    kind = "features"
    edits = False
    keeps_rows = True

    top_k: int | None = None

    def __post_init__(self) -> None:
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(
                self.top_k, Integral) or self.top_k < 1):
            raise ValueError(f"Features(sae={self.sae!r}, top_k={self.top_k!r}): top_k must be "
                             "a whole number of features, at least 1, or None")
        super().__post_init__()

    def data_fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        """`top_k` as a Python int (numpy integers do not travel)."""
        fields = super().data_fields(fields)
        return {**fields, "top_k": None if self.top_k is None else int(self.top_k)}

    def saved_names(self, location: str) -> tuple[str, ...]:
        """The feature indices and values, under the SAE's name."""
        return feature_names(self.sae)

    def saved_bytes(self, location: str, value: ValueShape, prompt_length: int,
                    max_tokens: int, saes: SAESizes) -> int:
        """`top_k` indices (int64) and values (the SAE's dtype) for each row it reads; for
        `top_k=None` a TopK SAE's `k`, any other SAE's every feature (how many are active is
        known only as it runs). Nothing for an SAE the engine has not (refused anyway)."""
        sae = saes.get(self.sae)
        if sae is None:
            return 0
        features = self.top_k or sae.get("k") or int(sae["d_sae"])
        value_bytes = getattr(torch, str(sae["dtype"])).itemsize
        return self.kept_rows(location, value, prompt_length, max_tokens) * features * (
            8 + value_bytes)

    def bound(self, sae: SAE, location: str) -> Op:
        """The worker's reader of this SAE's features at `location`."""
        top_k = self.top_k if self.top_k is not None else sae.k
        if top_k is not None and top_k > sae.d_sae:
            raise ValueError(f"Features(sae={self.sae!r}, top_k={top_k}): the SAE has "
                             f"{sae.d_sae} features; choose top_k <= {sae.d_sae}")
        return FeatureReads(location, sae_name=self.sae, sae=sae, top_k=top_k,
                            positions=self.positions, steps=self.steps, tokens=self.tokens)


@dataclass(frozen=True)
class FeatureReads(RowResults):
    """`Features` bound to its SAE in a worker (never sent): encode the rows it keeps and save
    the `top_k` largest features of each; requests running the same one are encoded together
    (one pass over the encoder's weights for all their rows). `top_k=None`: every active
    feature, as many as the step's busiest row has, so pieces of a request differ in width
    (padded to the widest when collected) and each request is served alone."""

    kind = "features"
    #: What pads the indices and the values of rows with fewer active features.
    FILLS: ClassVar[tuple[float, float]] = (-1, 0.0)

    sae_name: str = field(kw_only=True)
    sae: SAE = field(kw_only=True, repr=False, compare=False)
    top_k: int | None = field(kw_only=True)

    def saved_names(self, location: str) -> tuple[str, ...]:
        """As the `Features` it binds."""
        return feature_names(self.sae_name)

    def serve_group(self, server: GroupServer) -> bool:
        """Together where every row keeps `top_k` features; one by one where each keeps its
        active ones (the widths differ from request to request)."""
        return self.top_k is not None and super().serve_group(server)

    def row_results(self, rows: torch.Tensor, services: Services) -> tuple[torch.Tensor, ...]:
        """`(indices, values)` of the `top_k` largest features of each row of `rows`
        (`[1, tokens, d_in]`), each `[tokens, top_k]`; -1 (and 0) where fewer are active.
        `top_k=None`: as many as the busiest row has active."""
        if rows.dim() != 3:
            raise ValueError(f"an SAE reads a value of one row per token [batch tokens width], "
                             f"not one of shape {list(rows.shape)}")
        encoded = self.sae.encode(rows[0])
        top_k = self.top_k
        if top_k is None:  # the one wait for the device: how many to keep
            top_k = int((encoded != 0).sum(-1).max()) if encoded.shape[0] else 0
        values, indices = encoded.topk(top_k, dim=-1)
        return indices.masked_fill(values == 0, -1), values

    def serve(self, visit: Visit) -> None:
        """Encode the rows the op keeps and save their top features (rank 0 keeps them)."""
        if not visit.services.keeps_saves:
            return
        found = [(first, tuple(result.unsqueeze(0) for result in self.row_results(
            rows, visit.services))) for first, rows in self.selected_reads(visit)]
        width = self.top_k or 0
        self.keep_results(visit, self.saved_names(visit.location), found, lambda device: (
            torch.empty(1, 0, width, dtype=torch.long, device=device),
            torch.empty(1, 0, width, dtype=self.sae.dtype, device=device)),
            None if self.top_k is not None else self.FILLS)


def _check_features(op: SAEOp, features: Any) -> dict[int, float]:
    """`features` as `{index: value}`, refused by name unless whole indices >= 0 map to finite
    numbers."""
    name = f"{type(op).__name__}(sae={op.sae!r})"
    pairs = features.items() if isinstance(features, dict) else features
    try:
        given = [(index, value) for index, value in pairs]
    except (TypeError, ValueError):
        raise ValueError(f"{name}: features must map feature indices to values, e.g. "
                         "{1234: 8.0}") from None
    if not given:
        raise ValueError(f"{name}: features is empty; name at least one feature")
    checked: dict[int, float] = {}
    for index, value in given:
        if isinstance(index, bool) or not isinstance(index, Integral) or index < 0:
            raise ValueError(f"{name}: feature index {index!r} must be a whole number >= 0")
        if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
            raise ValueError(f"{name}: feature {index} has value {value!r}; give a finite number")
        checked[int(index)] = float(value)
    return checked


@dataclass(frozen=True)
class _FeatureValues(SAEOp):
    """An SAE op that takes `features`, `{index: value}`."""

    features: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "features", _check_features(self, self.features))
        super().__post_init__()

    def on(self, sae: SAE) -> tuple[torch.Tensor, torch.Tensor]:
        """`features` as indices (int64) and values (the SAE's dtype) on the SAE's device,
        refused by name past its `d_sae`."""
        beyond = [index for index in self.features if index >= sae.d_sae]
        if beyond:
            raise ValueError(f"{type(self).__name__}(sae={self.sae!r}): features "
                             f"{listed(beyond)} are not among the SAE's {sae.d_sae} (indices "
                             f"0..{sae.d_sae - 1})")
        device = sae.W_dec.device
        return (torch.tensor(list(self.features), dtype=torch.long, device=device),
                torch.tensor(list(self.features.values()), dtype=sae.dtype, device=device))

    def data_fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        """`features` as `[[index, value], ...]` (plain data with string-free keys)."""
        fields = super().data_fields(fields)
        return {**fields, "features": [[index, value] for index, value in self.features.items()]}

    @classmethod
    def fields_from_data(cls, fields: dict[str, Any]) -> dict[str, Any]:
        """`features` back as a dict; from JSON, an object's keys are the indices as text
        (anything else is left for the op's own check to name)."""
        given = fields.get("features")
        pairs = given.items() if isinstance(given, dict) else given
        if pairs is None:
            return fields
        try:
            found = {int(index) if isinstance(index, str) and index.isdigit() else index: value
                     for index, value in pairs}
        except (TypeError, ValueError):
            return fields
        return {**fields, "features": found}


@dataclass(frozen=True)
class SteerFeatures(_FeatureValues):
    """Add `value * W_dec[f]`, summed over `features` (`{f: value}`), to the value the SAE reads,
    on this request's rows: steering by the SAE's decoder directions. Bound in the worker, it is
    an `Add`, served wherever an `Add` is (inside compiled graphs at graph taps)."""

    kind = "steer_features"

    def bound(self, sae: SAE, location: str) -> Op:
        """The `Add` of the summed directions, in the SAE's dtype."""
        indices, values = self.on(sae)
        return Add(location, values @ sae.W_dec.index_select(0, indices),
                   positions=self.positions, steps=self.steps, tokens=self.tokens)


@dataclass(frozen=True)
class ClampFeatures(_FeatureValues):
    """Set `features` (`{f: value}`) of the SAE's encoding of each row and write back
    `x + decode(f') - decode(f)`: the row with those features changed and the SAE's
    reconstruction error kept, so clamping a feature to its encoded value changes nothing.
    Ablate a feature with value 0."""

    kind = "clamp_features"

    def bound(self, sae: SAE, location: str) -> Op:
        """The worker's clamp, holding the SAE and the features' indices and values."""
        indices, values = self.on(sae)
        return FeatureClamp(location, sae_name=self.sae, sae=sae, indices=indices, values=values,
                            positions=self.positions, steps=self.steps, tokens=self.tokens)


@dataclass(frozen=True)
class FeatureClamp(EditOp):
    """`ClampFeatures` bound to its SAE in a worker (never sent). Decoding is linear, so
    `decode(f') - decode(f)` is `(values - f[indices]) @ W_dec[indices]`: only the clamped
    features' decoder rows are touched, and for an SAE whose features each depend on their own
    pre-activation alone (standard, JumpReLU) only their encoder columns."""

    kind = "clamp_features"

    sae_name: str = field(kw_only=True)
    sae: SAE = field(kw_only=True, repr=False, compare=False)
    indices: torch.Tensor = field(kw_only=True, repr=False, compare=False)
    values: torch.Tensor = field(kw_only=True, repr=False, compare=False)

    def edited(self, current: torch.Tensor, layout: tuple[str, ...],
               operand: torch.Tensor | None = None) -> torch.Tensor:
        """`current + (values - f[indices]) @ W_dec[indices]`, added in `current`'s dtype."""
        change = (self.values - self.sae.encode_features(current, self.indices)) \
            @ self.sae.W_dec.index_select(0, self.indices)
        return current + change.to(current.dtype)
