"""Site names as SAE files give them, in TransformerLens's and HF's spelling, map to one
standard location each; anything else maps to none."""

from __future__ import annotations

import pytest
from saecodec import Site
from saecodec.sites import SITE_NAMES, site_location, standard_location


@pytest.mark.parametrize(("name", "location"), [
    ("blocks.12.hook_resid_post", "layers.12.layer_output"),
    ("blocks.0.hook_resid_pre", "layers.0.layer_input"),
    ("blocks.7.hook_attn_out", "layers.7.attention_output"),
    ("blocks.7.attn.hook_z", "layers.7.attention_head_outputs"),
    ("blocks.3.hook_mlp_out", "layers.3.mlp_output"),
    ("model.layers.12", "layers.12.layer_output"),
    ("model.layers.12.output", "layers.12.layer_output"),
    ("model.layers.5.self_attn.o_proj.input", "layers.5.attention_head_outputs"),
    ("model.layers.5.mlp.down_proj.input", "layers.5.mlp_neurons"),
    ("model.layers.20.input", "layers.20.layer_input"),
    ("layers.6", "layers.6.layer_output"),  # sparsify's hookpoints, under the base model
    ("layers.6.mlp", "layers.6.mlp_output"),
    ("layers.6.self_attn", "layers.6.attention_output"),
    ("layers.6.attention", "layers.6.attention_output"),
    ("h.6", "layers.6.layer_output"),
    ("h.6.mlp.act", "layers.6.mlp_neurons"),
])
def test_each_spelling_maps_to_its_standard_location(name: str, location: str) -> None:
    assert standard_location(name) == location


@pytest.mark.parametrize("name", [
    "blocks.12.hook_resid_post.extra", "model.layers.5.post_feedforward_layernorm.output",
    "blocks.x.hook_resid_post", "model.layers.12.outputs", "hook_resid_post", "",
    "embed_tokens", "layers.6.mlp.act_fn", "layers", "h.6.ln_1"])
def test_a_site_outside_the_table_has_no_location(name: str) -> None:
    assert standard_location(name) is None


def test_every_row_of_the_table_maps_to_itself_at_any_layer() -> None:
    for site, location in SITE_NAMES:
        for layer in (0, 9, 31):
            assert standard_location(site.replace("{L}", str(layer))) == \
                location.replace("{L}", str(layer))


def test_an_sae_maps_by_either_name_and_never_by_two_that_disagree() -> None:
    assert site_location(Site("blocks.4.hook_resid_post", None)) == "layers.4.layer_output"
    assert site_location(Site(None, "model.layers.4")) == "layers.4.layer_output"
    assert site_location(Site("blocks.4.hook_resid_post", "model.layers.4.output")) == \
        "layers.4.layer_output"
    assert site_location(Site("blocks.4.hook_resid_post", "model.layers.5.output")) is None
    assert site_location(Site(None, None)) is None
