"""`SAE`'s math, written out by hand per architecture (SAELens's definitions; SAELens itself
is the oracle of the formats tests to come), and its checks of its own weights."""

from __future__ import annotations

import pytest
import torch
from conftest import D_IN, D_SAE, random_weights
from hypothesis import given, settings
from hypothesis import strategies as st
from saecodec import ARCHITECTURES, SAE


def make(architecture: str, seed: int = 0, **fields: object) -> SAE:
    weights = random_weights(architecture, seed)
    k = 5 if architecture == "topk" else None
    return SAE(architecture, weights["W_enc"], weights["b_enc"], weights["W_dec"],
               weights["b_dec"], threshold=weights.get("threshold"), k=k,
               b_mag=weights.get("b_mag"), r_mag=weights.get("r_mag"),
               **fields)  # type: ignore[arg-type]


def by_hand(sae: SAE, x: torch.Tensor) -> torch.Tensor:
    """The features, one token and one feature at a time."""
    out = torch.zeros(*x.shape[:-1], sae.d_sae)
    for token in torch.cartesian_prod(*(torch.arange(n) for n in x.shape[:-1])).reshape(
            -1, x.dim() - 1).tolist():
        row = x[tuple(token)]
        if sae.apply_b_dec_to_input:
            row = row - sae.b_dec
        pre = [float(row @ sae.W_enc[:, f] + sae.b_enc[f]) for f in range(sae.d_sae)]
        if sae.architecture == "standard":
            acts = [max(v, 0.0) for v in pre]
        elif sae.architecture == "jumprelu":
            assert sae.threshold is not None
            acts = [v if v > float(sae.threshold[f]) and v > 0 else 0.0
                    for f, v in enumerate(pre)]
        elif sae.architecture == "gated":  # the gate's pre-activation; then the magnitude's
            assert sae.b_mag is not None and sae.r_mag is not None
            magnitudes = [float(row @ (sae.W_enc[:, f] * sae.r_mag[f].exp()) + sae.b_mag[f])
                          for f in range(sae.d_sae)]
            acts = [max(magnitude, 0.0) if gate > 0 else 0.0
                    for gate, magnitude in zip(pre, magnitudes, strict=True)]
        else:
            assert sae.k is not None
            keep = sorted(range(sae.d_sae), key=lambda f: pre[f], reverse=True)[:sae.k]
            acts = [max(pre[f], 0.0) if f in keep else 0.0 for f in range(sae.d_sae)]
        out[tuple(token)] = torch.tensor(acts)
    return out


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("apply_b_dec_to_input", [False, True])
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), tokens=st.integers(1, 4))
def test_encode_is_the_architectures_definition(architecture: str, apply_b_dec_to_input: bool,
                                                seed: int, tokens: int) -> None:
    sae = make(architecture, apply_b_dec_to_input=apply_b_dec_to_input)
    x = torch.randn(1, tokens, D_IN, generator=torch.Generator().manual_seed(seed))
    features = sae.encode(x)
    assert features.shape == (1, tokens, D_SAE)
    torch.testing.assert_close(features, by_hand(sae, x), rtol=1e-5, atol=1e-5)
    if architecture == "topk":
        assert int((features != 0).sum(-1).max()) <= 5


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("apply_b_dec_to_input", [False, True])
def test_some_features_encode_as_in_the_whole_encoding(architecture: str,
                                                       apply_b_dec_to_input: bool) -> None:
    sae = make(architecture, apply_b_dec_to_input=apply_b_dec_to_input)
    x = torch.randn(2, 3, D_IN, generator=torch.Generator().manual_seed(4))
    features = torch.tensor([D_SAE - 1, 0, 3])
    torch.testing.assert_close(sae.encode_features(x, features),
                               sae.encode(x)[..., features], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_decode_and_the_error_term_put_the_activations_back_together(architecture: str) -> None:
    sae = make(architecture)
    x = torch.randn(3, D_IN, generator=torch.Generator().manual_seed(7))
    features = sae.encode(x)
    torch.testing.assert_close(sae.decode(features), features @ sae.W_dec + sae.b_dec)
    torch.testing.assert_close(sae.decode(features) + sae.error(x), x)


def test_an_sae_computes_in_its_own_dtype_and_moves_whole() -> None:
    sae = make("jumprelu").to(dtype=torch.float64)
    assert sae.dtype == torch.float64 and sae.threshold is not None
    assert sae.threshold.dtype == torch.float64
    assert sae.encode(torch.randn(2, D_IN)).dtype == torch.float64


@pytest.mark.parametrize(("change", "message"), [
    ({"b_enc": torch.zeros(D_SAE + 1)}, "b_enc has shape"),
    ({"W_dec": torch.zeros(D_IN, D_SAE)}, "W_dec has shape"),
    ({"threshold": None}, "threshold goes with the jumprelu"),
    ({"architecture": "batchtopk"}, "not one of"),
    ({"architecture": "gated", "threshold": None}, "b_mag and r_mag go with the gated"),
    ({"b_mag": torch.zeros(D_SAE), "r_mag": torch.zeros(D_SAE)}, "b_mag and r_mag go with"),
])
def test_inconsistent_weights_are_refused_by_name(change: dict[str, object], message: str
                                                  ) -> None:
    weights: dict[str, object] = dict(random_weights("jumprelu"))
    weights["architecture"] = "jumprelu"
    weights.update(change)
    architecture = weights.pop("architecture")
    with pytest.raises(ValueError, match=message):
        SAE(architecture, **weights)  # type: ignore[arg-type]


def test_topk_needs_a_k_within_its_width_and_inputs_their_width() -> None:
    weights = random_weights("topk")
    with pytest.raises(ValueError, match="k in 1"):
        SAE("topk", *weights.values(), k=D_SAE + 1)
    with pytest.raises(ValueError, match="reads 12"):
        make("standard").encode(torch.zeros(2, D_IN + 1))
    with pytest.raises(ValueError, match="has 40"):
        make("standard").decode(torch.zeros(2, D_SAE - 1))
