"""The sparse autoencoders a worker loaded at start-up (`LLM(saes=...)`), by name: where each
reads, the resolution of the `sae:<name>` patterns SAE ops act at, and the binding of those ops
to the loaded weights (`ops.features`).

Each SAE is loaded once per worker, on the model's device, from its files on disk
(`saecodec.SAE.load`), and checked there against the model: its site must map to a standard
location (`saecodec.site_location`) the model serves as one row per token, of the SAE's
width. An SAE that fails a check is refused by name, with the reason, and the client stops the
engine (`LLM` raises `SAEsRefused`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from saecodec import SAE, Site, site_location
from vllm_envoys import Value

from vllm_runner.errors import LocationError
from vllm_runner.ops import Op
from vllm_runner.ops.features import SAE_PATTERN_PREFIX

#: The config fields that give the width of a value's last axis, by the axis' layout name.
WIDTHS = {"hidden": ("hidden_size", "n_embd", "d_model"),
          "intermediate": ("intermediate_size", "n_inner")}


@dataclass(frozen=True)
class LoadedSAE:
    """One SAE as a worker holds it: the weights, and the canonical location it reads."""

    sae: SAE
    location: str

    def describe(self) -> dict[str, Any]:
        """What a client learns of it (`LLM.saes`): plain data."""
        sae = self.sae
        return {"location": self.location, "architecture": sae.architecture,
                "d_in": sae.d_in, "d_sae": sae.d_sae, "k": sae.k,
                "dtype": str(sae.dtype).removeprefix("torch."), "hook_name": sae.site.hook_name,
                "hf_hook_name": sae.site.hf_hook_name}


def _site(name: str | None) -> Site | None:
    """A site given by name: TransformerLens's (`blocks.…`) or the HF model's module path."""
    if name is None:
        return None
    return Site(hook_name=name) if name.startswith("blocks.") else Site(hf_hook_name=name)


def _width(value: Value, hf_config: Any) -> int | None:
    """The width of a per-token value's last axis, from the model's config (None: unknown)."""
    text = getattr(hf_config, "get_text_config", lambda: hf_config)()
    for name in WIDTHS.get(value.eproperty.layout[-1], ()):
        found = getattr(text, name, None)
        if isinstance(found, int):
            return found
    return None


class LoadedSAEs:
    """The worker's SAEs by name, and those it refused with the reason."""

    def __init__(self) -> None:
        self.loaded: dict[str, LoadedSAE] = {}
        self.refused: dict[str, str] = {}

    def load(self, specs: Mapping[str, Mapping[str, str | None]], values: Mapping[str, Value],
             resolve: Callable[[str], list[str]], hf_config: Any, device: torch.device) -> None:
        """Load each SAE of `specs` (name -> its `path` and the `site` given for files that name
        none: `settings.saes_config`) onto `device`, refusing by name any whose files do not
        load, whose site maps to no location the model serves per token (`values`, by canonical
        location; `resolve` gives a location's canonical name), or whose width is not that
        value's."""
        for name, spec in specs.items():
            self.refused.pop(name, None)
            if name in self.loaded:  # programs decoded before are bound to the one loaded
                self.refused[name] = "an SAE is already loaded under this name; choose another"
                continue
            try:
                self.loaded[name] = self._checked(str(spec["path"]), _site(spec.get("site")),
                                                  values, resolve, hf_config, device)
            except (OSError, ValueError) as error:  # LocationError is a ValueError
                self.refused[name] = str(error)

    @staticmethod
    def _checked(path: str, site_given: Site | None, values: Mapping[str, Value],
                 resolve: Callable[[str], list[str]], hf_config: Any,
                 device: torch.device) -> LoadedSAE:
        sae = SAE.load(path, site=site_given)
        site = sae.site
        standard = site_location(site)
        if standard is None:
            named = site.hf_hook_name or site.hook_name or "not named in its files"
            raise ValueError(f"its site ({named}) maps to no standard location "
                             "(docs/vllm-runner.md, \"Features (SAEs)\", lists the sites that do)")
        try:
            (location,) = resolve(standard)
        except LocationError:
            raise ValueError(f"it reads {standard}, which this model does not serve") from None
        value = values[location]
        layout = value.eproperty.layout
        if len(layout) != 3 or layout[1] != "tokens":
            raise ValueError(f"it reads {location} [{' '.join(layout)}]; SAEs are served at "
                             "values of one row per token [batch tokens width]")
        width = _width(value, hf_config)
        if width is not None and width != sae.d_in:
            raise ValueError(f"it reads {sae.d_in} wide activations, but {location} is "
                             f"{width} wide in this model: an SAE trained on another model?")
        return LoadedSAE(sae.to(device), location)

    def describe(self) -> dict[str, dict[str, Any]]:
        """Every loaded SAE as plain data, by name."""
        return {name: loaded.describe() for name, loaded in self.loaded.items()}

    def resolve(self, pattern: str) -> list[str]:
        """The location `sae:<name>` names; `LocationError` naming the engine's SAEs if none."""
        return [self.lookup(pattern.removeprefix(SAE_PATTERN_PREFIX))[1]]

    def lookup(self, name: str) -> tuple[SAE, str]:
        """The SAE loaded as `name` and the location it reads; `LocationError` naming the
        engine's SAEs if there is none."""
        found = self.loaded.get(name)
        if found is None and name in self.refused:
            raise LocationError(f"the SAE {name!r} was refused when loaded: {self.refused[name]}")
        if found is None:
            have = ", ".join(sorted(self.loaded)) or "none: start it with LLM(saes={name: path})"
            raise LocationError(f"no SAE named {name!r} in this engine (its SAEs: {have})")
        return found.sae, found.location

    def bind(self, ops: tuple[Op, ...]) -> tuple[Op, ...]:
        """A decoded program's ops, those in an SAE's feature space bound to their SAE."""
        return tuple(op.with_saes(self.lookup) for op in ops)
