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
from vllm_envoys.transformers_backend import TransformersBackend

# (backend, model_type) -> family; the backend is "vllm" or "transformers" (see Family.backend).
_REGISTRY: dict[tuple[str, str], type[Family]] = {}
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
                    _REGISTRY.setdefault((value.backend, model_type), value)
    _LOADED = True


def register(family: type[Family], *model_types: str) -> None:
    """Use `family` for `model_types` (default: its own `model_types`), replacing any other."""
    _load_shipped()
    for model_type in model_types or family.model_types:
        _REGISTRY[(family.backend, model_type)] = family


def known(backend: str = "vllm") -> dict[str, type[Family]]:
    """Every `model_type` with a family for `backend` ("vllm" or "transformers")."""
    _load_shipped()
    return dict(sorted((t, f) for (b, t), f in _REGISTRY.items() if b == backend))


def lookup(model_type: str, backend: str = "vllm") -> type[Family]:
    """The family for `model_type` on `backend`.

    On vLLM's Transformers backend an architecture without its own family gets the generic one
    (transformers' module names; the residual stream and attention and MLP inputs and outputs).
    On vLLM's own model code there is no safe guess: `UnknownFamily` says which families exist
    and how to add one.
    """
    _load_shipped()
    found = _REGISTRY.get((backend, model_type))
    if found is not None:
        return found
    if backend == "transformers":
        return TransformersBackend
    raise UnknownFamily(
        f"no vllm-envoys family covers model_type {model_type!r}. Families exist for: "
        f"{', '.join(known())}. Add one by subclassing vllm_envoys.Family "
        "(see docs/vllm-envoys.md, 'Adding a family') and calling "
        "vllm_envoys.families.register(YourFamily). Models vLLM serves through its "
        "Transformers backend (model_impl='transformers') get a generic family."
    )
