"""SAELens itself as the oracle: SAEs that SAELens makes and saves (random weights, no
downloads) load here, and our `encode`, `decode` and error term equal SAELens's on the same
inputs, for every architecture this package knows."""

from __future__ import annotations

from pathlib import Path

import pytest
import sae_lens
import torch
from saecodec import ARCHITECTURES, SAE

D_IN, D_SAE = 24, 96


def saelens_sae(architecture: str, apply_b_dec_to_input: bool, seed: int) -> object:
    """An SAELens SAE of `architecture` with random weights (and thresholds for JumpReLU)."""
    common = {"d_in": D_IN, "d_sae": D_SAE, "apply_b_dec_to_input": apply_b_dec_to_input}
    sae = {"standard": lambda: sae_lens.StandardSAE(sae_lens.StandardSAEConfig(**common)),
           "jumprelu": lambda: sae_lens.JumpReLUSAE(sae_lens.JumpReLUSAEConfig(**common)),
           "topk": lambda: sae_lens.TopKSAE(sae_lens.TopKSAEConfig(**common, k=7)),
           "gated": lambda: sae_lens.GatedSAE(sae_lens.GatedSAEConfig(**common)),
           }[architecture]()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sae.named_parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator)
                            * (0.05 if name == "threshold" else 0.3))
            if name == "threshold":
                parameter.abs_()
    return sae


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("apply_b_dec_to_input", [True, False])
def test_an_sae_saelens_saved_encodes_and_decodes_as_saelens_does(
        tmp_path: Path, architecture: str, apply_b_dec_to_input: bool) -> None:
    theirs = saelens_sae(architecture, apply_b_dec_to_input, seed=len(architecture))
    theirs.save_model(tmp_path)  # type: ignore[attr-defined]
    ours = SAE.load(tmp_path)
    assert (ours.architecture, ours.d_in, ours.d_sae) == (architecture, D_IN, D_SAE)
    x = torch.randn(2, 9, D_IN, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        features = theirs.encode(x)  # type: ignore[attr-defined]
        assert int((features != 0).sum()) > 0  # the check could fail: features do fire
        torch.testing.assert_close(ours.encode(x), features, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.decode(features),
                                   theirs.decode(features),  # type: ignore[attr-defined]
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.error(x), x - theirs(x),  # type: ignore[operator]
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_an_sae_saved_here_loads_in_saelens_and_encodes_alike(tmp_path: Path,
                                                            architecture: str) -> None:
    theirs = saelens_sae(architecture, apply_b_dec_to_input=True, seed=11)
    theirs.save_model(tmp_path / "theirs")  # type: ignore[attr-defined]
    SAE.load(tmp_path / "theirs").save(tmp_path / "ours")
    again = sae_lens.SAE.load_from_disk(tmp_path / "ours")
    assert type(again) is type(theirs)
    x = torch.randn(4, D_IN, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(again.encode(x), theirs.encode(x))  # type: ignore[attr-defined]
