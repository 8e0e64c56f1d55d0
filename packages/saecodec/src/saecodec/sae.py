"""One sparse autoencoder: its weights, its architecture's nonlinearity, and the site it was
trained at.

The math is SAELens's (6.x), so features are comparable with theirs: the input, less `b_dec`
where `apply_b_dec_to_input`, times `W_enc [d_in, d_sae]` plus `b_enc` gives the
pre-activations; the architecture turns them into features (`standard`: ReLU; `jumprelu`: ReLU
kept only above each feature's `threshold`; `topk`: the `k` largest, ReLU'd, the rest zero;
`gated`: a feature is on where its pre-activation is above 0 (`b_enc` is the gate's bias,
SAELens's `b_gate`), and then its magnitude is the ReLU of the same product scaled by
`exp(r_mag)` plus `b_mag`); `decode` is `features @ W_dec + b_dec`. Computed in the SAE's
dtype; inputs are cast to it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

#: The architectures `encode` knows.
ARCHITECTURES = ("standard", "jumprelu", "topk", "gated")


@dataclass(frozen=True)
class Site:
    """Where an SAE was trained: its hook in TransformerLens's names (`blocks.12.hook_resid_post`)
    and, where its files say, in the HF model's module paths (`model.layers.12.output`)."""

    hook_name: str | None = None
    hf_hook_name: str | None = None


@dataclass(frozen=True, eq=False)
class SAE:
    """An SAE's weights and what its encoder does with them (see the module)."""

    architecture: str
    W_enc: torch.Tensor  # [d_in, d_sae]
    b_enc: torch.Tensor  # [d_sae]; a gated SAE's gate bias (SAELens's `b_gate`)
    W_dec: torch.Tensor  # [d_sae, d_in]
    b_dec: torch.Tensor  # [d_in]
    threshold: torch.Tensor | None = None  # [d_sae], JumpReLU only
    k: int | None = None  # TopK only
    apply_b_dec_to_input: bool = False
    site: Site = Site()
    b_mag: torch.Tensor | None = None  # [d_sae], gated only: the magnitudes' bias
    r_mag: torch.Tensor | None = None  # [d_sae], gated only: the magnitudes' log scale

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not one of "
                             f"{', '.join(ARCHITECTURES)}")
        d_in, d_sae = self.W_enc.shape
        expected = {"b_enc": (d_sae,), "W_dec": (d_sae, d_in), "b_dec": (d_in,)}
        for name in ("threshold", "b_mag", "r_mag"):
            if getattr(self, name) is not None:
                expected[name] = (d_sae,)
        for name, shape in expected.items():
            tensor = getattr(self, name)
            if tuple(tensor.shape) != shape:
                raise ValueError(f"{name} has shape {list(tensor.shape)}; with W_enc "
                                 f"[{d_in}, {d_sae}] it must be {list(shape)}")
        if (self.architecture == "jumprelu") != (self.threshold is not None):
            raise ValueError("a threshold goes with the jumprelu architecture, and only with it")
        if (self.architecture == "gated") != (self.b_mag is not None) or \
                (self.b_mag is None) != (self.r_mag is None):
            raise ValueError("b_mag and r_mag go with the gated architecture, both, and only "
                             "with it")
        if self.architecture == "topk":
            if self.k is None or not 0 < self.k <= d_sae:
                raise ValueError(f"a topk SAE needs k in 1..{d_sae}, not {self.k!r}")
        elif self.k is not None:
            raise ValueError(f"k goes with the topk architecture, not {self.architecture}")

    @classmethod
    def load(cls, path: str | Path, site: Site | None = None) -> SAE:
        """The SAE at `path`, in whichever format its files are (SAELens native, Gemma Scope's
        `.npz`, Gemma Scope 2, Llama Scope, sparsify: see `saecodec.formats`). `site` names
        the site where the files name none (Gemma Scope's `.npz`), and must agree with any
        they do name."""
        from saecodec.formats import load

        return load(path, site)

    def save(self, path: str | Path) -> None:
        """Write folder `path` in SAELens's native format (`cfg.json` +
        `sae_weights.safetensors`), which `SAE.load` and SAELens's `SAE.load_from_disk` read."""
        from saecodec.formats import save

        save(self, path)

    @property
    def d_in(self) -> int:
        """The width of the activations it reads."""
        return int(self.W_enc.shape[0])

    @property
    def d_sae(self) -> int:
        """How many features it has."""
        return int(self.W_enc.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        """The dtype it computes in."""
        return self.W_enc.dtype

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
           ) -> SAE:
        """This SAE with its tensors on `device` and/or in `dtype`."""
        def moved(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to(device=device, dtype=dtype)

        def optional(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else moved(tensor)

        return replace(self, W_enc=moved(self.W_enc), b_enc=moved(self.b_enc),
                       W_dec=moved(self.W_dec), b_dec=moved(self.b_dec),
                       threshold=optional(self.threshold), b_mag=optional(self.b_mag),
                       r_mag=optional(self.r_mag))

    def _input(self, activations: torch.Tensor) -> torch.Tensor:
        """`activations` in the SAE's dtype, less `b_dec` where `apply_b_dec_to_input`."""
        if activations.shape[-1] != self.d_in:
            raise ValueError(f"activations have width {activations.shape[-1]}; this SAE reads "
                             f"{self.d_in}")
        x = activations.to(self.dtype)
        return x - self.b_dec if self.apply_b_dec_to_input else x

    def pre_activations(self, activations: torch.Tensor) -> torch.Tensor:
        """`(x - b_dec?) @ W_enc + b_enc` over the last axis (`[..., d_in]` → `[..., d_sae]`);
        a gated SAE's gate pre-activations."""
        return self._input(activations) @ self.W_enc + self.b_enc

    def _each_alone(self, product: torch.Tensor, features: torch.Tensor | None = None
                    ) -> torch.Tensor:
        """Standard, JumpReLU and gated features from `product`, the input times the encoder's
        columns of `features` (`None`: every one): each feature from its own pre-activation
        alone (ReLU, kept only above its `threshold` where there is one; gated: its magnitude
        where its gate is open)."""
        def of(tensor: torch.Tensor) -> torch.Tensor:
            return tensor if features is None else tensor.index_select(0, features)

        hidden = product + of(self.b_enc)
        if self.b_mag is not None and self.r_mag is not None:
            magnitude = (product * of(self.r_mag).exp() + of(self.b_mag)).relu()
            return magnitude * (hidden > 0).to(hidden.dtype)
        if self.threshold is None:
            return hidden.relu()
        return hidden.relu() * (hidden > of(self.threshold)).to(hidden.dtype)

    def encode(self, activations: torch.Tensor) -> torch.Tensor:
        """The features of `activations` (`[..., d_in]` → `[..., d_sae]`, dense)."""
        if self.architecture != "topk":
            return self._each_alone(self._input(activations) @ self.W_enc)
        hidden = self.pre_activations(activations)
        assert self.k is not None
        top = hidden.topk(self.k, dim=-1)
        return torch.zeros_like(hidden).scatter(-1, top.indices, top.values.relu())

    def encode_features(self, activations: torch.Tensor, features: torch.Tensor
                        ) -> torch.Tensor:
        """`encode(activations)[..., features]` (`features`: int64 indices on the SAE's device),
        reading only those features' encoder columns where each feature depends on its own
        pre-activation alone (standard, JumpReLU, gated); a TopK SAE encodes in full (whether a
        feature is kept depends on the others)."""
        if self.architecture == "topk":
            return self.encode(activations).index_select(-1, features)
        return self._each_alone(
            self._input(activations) @ self.W_enc.index_select(1, features), features)

    def decode(self, features: torch.Tensor) -> torch.Tensor:
        """`features @ W_dec + b_dec` (`[..., d_sae]` → `[..., d_in]`)."""
        if features.shape[-1] != self.d_sae:
            raise ValueError(f"features have width {features.shape[-1]}; this SAE has "
                             f"{self.d_sae}")
        return features.to(self.dtype) @ self.W_dec + self.b_dec

    def error(self, activations: torch.Tensor) -> torch.Tensor:
        """What the SAE misses: `activations - decode(encode(activations))`, in its dtype."""
        return activations.to(self.dtype) - self.decode(self.encode(activations))
