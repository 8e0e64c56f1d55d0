"""The family registry: `model_type` → `Family`.

Shipped families live in modules of this package named after their main `model_type` and are
imported on first use, so importing vllm_envoys imports no model code. `register` adds or
overrides a family at run time.
"""

from __future__ import annotations

import importlib
import pkgutil

from vllm_envoys.errors import UnknownFamily
from vllm_envoys.family import Family

_REGISTRY: dict[str, type[Family]] = {}
_LOADED = False


def _load_shipped() -> None:
    global _LOADED
    if _LOADED:
        return
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, Family) and value.model_types:
                for model_type in value.model_types:
                    _REGISTRY.setdefault(model_type, value)
    _LOADED = True


def register(family: type[Family], *model_types: str) -> None:
    """Use `family` for `model_types` (default: its own `model_types`), replacing any other."""
    _load_shipped()
    for model_type in model_types or family.model_types:
        _REGISTRY[model_type] = family


def known() -> dict[str, type[Family]]:
    """Every `model_type` with a family, shipped or registered."""
    _load_shipped()
    return dict(sorted(_REGISTRY.items()))


def lookup(model_type: str) -> type[Family]:
    """The family for `model_type`; `UnknownFamily` says which exist and how to add one."""
    _load_shipped()
    try:
        return _REGISTRY[model_type]
    except KeyError:
        raise UnknownFamily(
            f"no vllm-envoys family covers model_type {model_type!r}. Families exist for: "
            f"{', '.join(sorted(_REGISTRY))}. Add one by subclassing vllm_envoys.Family "
            "(see docs/vllm-envoys.md, 'Adding a family') and calling "
            "vllm_envoys.families.register(YourFamily)."
        ) from None
