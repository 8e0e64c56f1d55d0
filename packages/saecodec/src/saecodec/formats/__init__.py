"""Loading an SAE from its files on disk into one `SAE`, whatever release format they are in,
and writing one in SAELens's native format.

`load` looks at the files present and reads them as the format they belong to (each loader
gives what SAELens 6.54's own loader for that format gives, but for sparsify's `b_dec`, which
is subtracted from the input as sparsify does and SAELens does not: see `sparsify`):

| format | files | module |
|---|---|---|
| SAELens native | `cfg.json` + `sae_weights.safetensors` | `native` |
| EleutherAI sparsify | `cfg.json` + `sae.safetensors` (one hookpoint's folder) | `sparsify` |
| Llama Scope | `hyperparams.json` + `checkpoints/final.safetensors` | `llamascope` |
| Gemma Scope 2 | `config.json` + `params.safetensors` | `gemmascope` |
| Gemma Scope | `params.npz` (the folder or the file) | `gemmascope` |

A site the files do not name (Gemma Scope's `.npz` names none) comes from `site`; one they do
name must agree with it. Foreign formats load in float32 (as SAELens's `from_pretrained` gives
them); the native one in its config's dtype. Every failure is an `SAEFormatError` naming the
file and the key.
"""

from __future__ import annotations

from pathlib import Path

from saecodec.errors import SAEFormatError
from saecodec.formats import gemmascope, llamascope, native, sparsify
from saecodec.formats._files import read_json
from saecodec.formats.native import CONFIG, PLAIN_NORMALISATIONS, WEIGHTS, save
from saecodec.sae import SAE, Site

__all__ = ["CONFIG", "FORMATS", "PLAIN_NORMALISATIONS", "WEIGHTS", "load", "save"]

#: The formats `load` reads, and the files that make each one.
FORMATS = (
    ("SAELens native", f"{native.CONFIG} + {native.WEIGHTS}"),
    ("EleutherAI sparsify", f"{sparsify.CONFIG} + {sparsify.WEIGHTS}"),
    ("Llama Scope", f"{llamascope.CONFIG} + {llamascope.WEIGHTS}"),
    ("Gemma Scope 2", f"{gemmascope.CONFIG} + {gemmascope.PARAMS}"),
    ("Gemma Scope", gemmascope.PARAMS_NPZ),
)
_KNOWN = "; ".join(f"{name}: {files}" for name, files in FORMATS)


def load(path: str | Path, site: Site | None = None) -> SAE:
    """The SAE at `path`: a folder in one of `FORMATS`, or a Gemma Scope `.npz` file. `site`
    gives the site where the files name none, and must agree with any they do name."""
    given = Path(path)
    if given.is_file():
        if given.suffix == ".npz":
            return gemmascope.load_npz(given, site)
        raise SAEFormatError(given, "is a file; give the folder that holds the SAE (or a "
                             f"Gemma Scope .npz). Formats read: {_KNOWN}")
    if not given.is_dir():
        raise SAEFormatError(given, f"is not a folder holding an SAE (formats read: {_KNOWN})")

    def has(name: str) -> bool:
        return (given / name).exists()

    if has(native.WEIGHTS):
        return native.load(given, site)
    if has(sparsify.WEIGHTS):
        return sparsify.load(given, site)
    if has(llamascope.CONFIG) or has(llamascope.WEIGHTS):
        return llamascope.load(given, site)
    if has(gemmascope.PARAMS):
        return gemmascope.load_gemma_scope_2(given, site)
    if has(gemmascope.PARAMS_NPZ):
        return gemmascope.load_npz(given, site)
    # A config without its weights: read it as its format, which names the missing file
    if has(native.CONFIG):
        return (sparsify.load if _is_sparsify(given / native.CONFIG) else native.load)(
            given, site)
    inside = sorted(child.name for child in given.iterdir()
                    if child.is_dir() and any((child / name).exists() for name in (
                        native.CONFIG, llamascope.CONFIG, gemmascope.CONFIG,
                        gemmascope.PARAMS_NPZ)))
    if inside:
        # a sparsify run (or a release) with one SAE per subfolder, and `config.json` beside
        raise SAEFormatError(given, f"holds one SAE per subfolder ({', '.join(inside[:6])}"
                             f"{', ...' if len(inside) > 6 else ''}): load one of them")
    if has(gemmascope.CONFIG):
        return gemmascope.load_gemma_scope_2(given, site)
    raise SAEFormatError(given, f"holds no SAE in a format read here (formats read: {_KNOWN})")


def _is_sparsify(config: Path) -> bool:
    """Whether `cfg.json` is sparsify's (its `SparseCoderConfig` fields) not SAELens's."""
    try:
        fields = read_json(config)
    except SAEFormatError:
        return False  # the native loader names what is wrong with it
    return "architecture" not in fields and ("num_latents" in fields or
                                             "expansion_factor" in fields)
