"""What every format's loader does with its files: read JSON and safetensors, check tensors'
names and shapes, settle the site, and build the `SAE`; each failure names the file and the key
(a JSON field or a tensor name), so a user can find what is wrong without reading this code."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from saecodec.errors import SAEFormatError
from saecodec.sae import SAE, Site

#: The dtype the foreign formats load in: SAELens's `from_pretrained` gives them in float32
#: (its default), whatever the file holds, and the folds some need are exact only in float32.
FOREIGN_DTYPE = torch.float32


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; missing, unreadable or not an object is refused."""
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise SAEFormatError(path, "is missing") from None
    except (OSError, ValueError) as error:
        raise SAEFormatError(path, f"is not readable JSON ({error})") from None
    if not isinstance(config, dict):
        raise SAEFormatError(path, "holds no JSON object")
    return config


def field(config: dict[str, Any], key: str, path: Path, default: Any = None,
          name: str | None = None) -> Any:
    """`config[key]` (or `default`); a field with no value is refused by name (`name`, where
    the field sits inside another: `dataset_average_activation_norm.in`)."""
    value = config.get(key, default)
    if value is None:
        raise SAEFormatError(path, "has no value", name or key)
    return value


def number(config: dict[str, Any], key: str, path: Path, *, positive: bool = False,
           name: str | None = None) -> float:
    """A numeric field, as a float; a string, a bool or (where `positive`) a value <= 0 is
    refused by name: a norm or a threshold read wrong would silently change every feature."""
    name = name or key
    value = field(config, key, path, name=name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SAEFormatError(path, f"{name}={value!r} is not a number", name)
    if positive and not value > 0:
        raise SAEFormatError(path, f"{name}={value!r} must be positive", name)
    return float(value)


def integer(config: dict[str, Any], key: str, path: Path, default: Any = None) -> int:
    """An integer field; a float, a string or a bool is refused by name."""
    value = field(config, key, path, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SAEFormatError(path, f"{key}={value!r} is not an integer", key)
    return value


def refuse_unless(config: dict[str, Any], key: str, path: Path, allowed: Iterable[Any],
                  why: str) -> None:
    """Refuse, naming `key`, a config whose `key` is set to anything outside `allowed` (absent
    counts as `None`): the format can say something this package does not model, and loading
    it anyway would give wrong features without a word."""
    value = config.get(key)
    if value not in tuple(allowed):
        raise SAEFormatError(path, f"{key}={value!r}: {why}", key)


def read_site(config: dict[str, Any], path: Path, key_in: str, key_out: str,
              what: str) -> str | None:
    """The site an SAE's config names under `key_in` (`what` it is: "a module path", "a hook
    name"), or `None`; a config whose `key_out` names another site is a transcoder's (it
    writes elsewhere than it reads), refused by name."""
    hook_in, hook_out = config.get(key_in), config.get(key_out)
    if hook_out is not None and hook_out != hook_in:
        raise SAEFormatError(path, f"{key_out} {hook_out!r} differs from {key_in} {hook_in!r}: "
                             "a transcoder, which this package does not model", key_out)
    if hook_in is not None and not isinstance(hook_in, str):
        raise SAEFormatError(path, f"{key_in}={hook_in!r} is not {what}", key_in)
    return hook_in


def read_safetensors(path: Path, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors `names` in safetensors file `path` (all of them if `names` is None); a
    missing file, a foreign file or a missing tensor is refused by name."""
    if not path.is_file():
        raise SAEFormatError(path, "is missing")
    try:
        with safe_open(str(path), framework="pt") as handle:
            present = set(handle.keys())
            wanted = sorted(present) if names is None else list(names)
            for name in wanted:
                if name not in present:
                    raise SAEFormatError(path, f"has no tensor {name!r} (it holds "
                                         f"{', '.join(sorted(present)) or 'none'})", name)
            return {name: handle.get_tensor(name) for name in wanted}
    except SAEFormatError:
        raise
    except Exception as error:  # a truncated or foreign file: safetensors says why
        raise SAEFormatError(path, f"is not a readable safetensors file ({error})") from None


def take(tensors: dict[str, torch.Tensor], path: Path, required: Iterable[str],
         ignored: Iterable[str] = (), refused: dict[str, str] | None = None
         ) -> dict[str, torch.Tensor]:
    """The `required` tensors of those read from `path`. A tensor named in `refused` is refused
    with its reason; any other tensor neither required nor `ignored` (a prefix) is refused as
    unknown: a weight we would drop is part of a computation we would not do."""
    required = list(required)
    for name in required:
        if name not in tensors:
            raise SAEFormatError(path, f"has no tensor {name!r} (it holds "
                                 f"{', '.join(sorted(tensors)) or 'none'})", name)
    for name in sorted(tensors):
        if refused and name in refused:
            raise SAEFormatError(path, f"holds {name!r}: {refused[name]}", name)
        if name not in required and not any(name.startswith(p) for p in ignored):
            raise SAEFormatError(path, f"holds tensor {name!r}, which this format's SAEs do not "
                                 f"have (expected {', '.join(required)})", name)
    return {name: tensors[name] for name in required}


def expect_shape(path: Path, key: str, tensor: torch.Tensor, shape: tuple[int, ...],
                 meaning: str) -> None:
    """Refuse, naming `key`, a tensor whose shape is not `shape` (`meaning` spells it out)."""
    if tuple(tensor.shape) != shape:
        raise SAEFormatError(path, f"{key} has shape {list(tensor.shape)}; it must be "
                             f"{list(shape)} ({meaning})", key)


def expect_matrix(path: Path, key: str, tensor: torch.Tensor, meaning: str) -> tuple[int, int]:
    """The two sizes of `tensor`, which must be a matrix (`meaning` says of what)."""
    if tensor.dim() != 2:
        raise SAEFormatError(path, f"{key} has shape {list(tensor.shape)}; it must be a "
                             f"matrix {meaning}", key)
    rows, columns = tensor.shape
    return int(rows), int(columns)


#: A module path as HF and sparsify name one (`layers.6`, `model.layers.6.mlp`).
MODULE_PATH = re.compile(r"[A-Za-z_]\w*(\.\w+)*\Z")


def settle_site(found: Site, given: Site | None, path: Path) -> Site:
    """The site the files name (`found`), completed by the one the caller gives: each name the
    files lack is taken from `given`; a name both give differently is refused (naming the file
    and the field), since one of them is wrong and features read at the wrong site mean
    nothing."""
    if given is None:
        return found
    names: dict[str, str | None] = {}
    for key in ("hook_name", "hf_hook_name"):
        ours, theirs = getattr(found, key), getattr(given, key)
        if ours is not None and theirs is not None and ours != theirs:
            raise SAEFormatError(path, f"names {key} {ours!r}, but the site given to load "
                                 f"says {theirs!r}", key)
        names[key] = ours if ours is not None else theirs
    return Site(hook_name=names["hook_name"], hf_hook_name=names["hf_hook_name"])


def build(path: Path, architecture: str, tensors: dict[str, torch.Tensor], *,
          k: int | None = None, apply_b_dec_to_input: bool = False, site: Site | None = None
          ) -> SAE:
    """The `SAE` from tensors named as `SAE`'s fields; what `SAE` refuses names `path`."""
    try:
        return SAE(architecture, tensors["W_enc"], tensors["b_enc"], tensors["W_dec"],
                   tensors["b_dec"], threshold=tensors.get("threshold"), k=k,
                   apply_b_dec_to_input=apply_b_dec_to_input, site=site or Site(),
                   b_mag=tensors.get("b_mag"), r_mag=tensors.get("r_mag"))
    except ValueError as error:
        raise SAEFormatError(path, str(error)) from None
