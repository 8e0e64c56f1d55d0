"""Where an SAE reads, in nnterp's standard names: the site its files name, in TransformerLens's
hook names (`blocks.12.hook_resid_post`), the HF model's module paths
(`model.layers.12.output`) or sparsify's hookpoints (`layers.12`, a module path under the base
model), as a location `layers.12.layer_output`.

One table (`SITE_NAMES`) holds every mapping; a site it does not hold has no standard location
(`standard_location` gives `None`), and an engine refuses such an SAE by name rather than guess.
Head-wise sites (`hook_z`, the `o_proj` input) map to the heads' outputs: an SAE there reads
them flattened, heads times head size.
"""

from __future__ import annotations

import re

from saecodec.sae import Site

#: (site pattern with `{L}` for the layer, its standard location with `{L}`), TL names first.
SITE_NAMES: tuple[tuple[str, str], ...] = (
    ("blocks.{L}.hook_resid_pre", "layers.{L}.layer_input"),
    ("blocks.{L}.hook_resid_mid", "layers.{L}.layer_mid"),
    ("blocks.{L}.hook_resid_post", "layers.{L}.layer_output"),
    ("blocks.{L}.hook_attn_out", "layers.{L}.attention_output"),
    ("blocks.{L}.attn.hook_z", "layers.{L}.attention_head_outputs"),
    ("blocks.{L}.hook_mlp_in", "layers.{L}.mlp_input"),
    ("blocks.{L}.mlp.hook_post", "layers.{L}.mlp_neurons"),
    ("blocks.{L}.hook_mlp_out", "layers.{L}.mlp_output"),
    ("model.layers.{L}.input", "layers.{L}.layer_input"),
    ("model.layers.{L}", "layers.{L}.layer_output"),
    ("model.layers.{L}.output", "layers.{L}.layer_output"),
    ("model.layers.{L}.self_attn.input", "layers.{L}.attention_input"),
    ("model.layers.{L}.self_attn.o_proj.input", "layers.{L}.attention_head_outputs"),
    ("model.layers.{L}.self_attn.output", "layers.{L}.attention_output"),
    ("model.layers.{L}.self_attn.o_proj.output", "layers.{L}.attention_output"),
    ("model.layers.{L}.mlp.input", "layers.{L}.mlp_input"),
    ("model.layers.{L}.mlp.down_proj.input", "layers.{L}.mlp_neurons"),
    ("model.layers.{L}.mlp.output", "layers.{L}.mlp_output"),
    ("model.layers.{L}.mlp.down_proj.output", "layers.{L}.mlp_output"),
    # EleutherAI sparsify's hookpoints: module paths under the HF model's base model, named by
    # the module whose output the SAE reads (`layers.6` is `model.layers.6` in a Llama, and
    # `gpt_neox.layers.6` in a Pythia; GPT-2's blocks are `h.6`).
    ("layers.{L}", "layers.{L}.layer_output"),
    ("layers.{L}.self_attn", "layers.{L}.attention_output"),
    ("layers.{L}.attention", "layers.{L}.attention_output"),
    ("layers.{L}.mlp", "layers.{L}.mlp_output"),
    ("h.{L}", "layers.{L}.layer_output"),
    ("h.{L}.attn", "layers.{L}.attention_output"),
    ("h.{L}.mlp", "layers.{L}.mlp_output"),
    ("h.{L}.mlp.act", "layers.{L}.mlp_neurons"),
)

_PATTERNS = tuple((re.compile(re.escape(site).replace(r"\{L\}", r"(\d+)") + r"\Z"), location)
                  for site, location in SITE_NAMES)


def standard_location(name: str) -> str | None:
    """The standard location of one site name (TL or HF), or `None` where the table has none."""
    for pattern, location in _PATTERNS:
        found = pattern.match(name)
        if found is not None:
            return location.replace("{L}", found.group(1))
    return None


def site_location(site: Site) -> str | None:
    """An SAE's standard location: from its HF name where it has one, else its TL name; `None`
    where neither maps (or the two map to different places: the files contradict themselves)."""
    found = {standard_location(name) for name in (site.hf_hook_name, site.hook_name)
             if name is not None}
    found.discard(None)
    return found.pop() if len(found) == 1 else None
