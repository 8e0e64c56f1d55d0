"""The family-by-value availability table, computed from the family declarations alone.

It needs no model and no engine: each family's host classes declare their values and the fixed
reasons for the ones they lack. Values whose availability depends on the step (the attention
pattern) or on the layer's router are marked as such. `docs/vllm-envoys.md` embeds this table,
and a test keeps the two equal.
"""

from __future__ import annotations

from vllm_envoys.eproperty import EProperty
from vllm_envoys.families import known
from vllm_envoys.family import Family
from vllm_envoys.hosts import Layer
from vllm_envoys.transformers_backend import TransformersBackend

MARKERS = ("<!-- support-table -->", "<!-- /support-table -->")


def _cell(eprop: EProperty | None) -> str:
    if eprop is None:
        return "—"
    if eprop.when:
        return f"✓ ({eprop.when})"
    if eprop.unavailable is not None:
        return "✗"
    return "✓" if eprop.writable else "✓ (read-only)"


def _values(family: type[Family]) -> dict[str, EProperty]:
    """Every value a family's layers can carry (MoE families: as on their routed layers)."""
    layer: type[Layer] = family.Layer
    found = dict(family.Model.eproperties())
    found.update(layer.eproperties())
    found.update(layer.Attention.eproperties())
    found.update((layer.Moe if family.mixture_of_experts else layer.Mlp).eproperties())
    return found


def families() -> list[tuple[str, type[Family]]]:
    """Every shipped family, by name: vLLM's model code first, then the Transformers backend."""
    seen: dict[type[Family], str] = {}
    for model_type, family in known("vllm").items():
        seen.setdefault(family, model_type)
    # A model type can be on both (OLMoE: vLLM's own code until 0.33, the backend from 0.34).
    for model_type, family in known("transformers").items():
        seen.setdefault(family, f"{model_type} (Transformers backend)")
    seen.setdefault(TransformersBackend, "generic (Transformers backend)")
    return [(name, family) for family, name in seen.items()]


def support_table() -> str:
    """A markdown table: one row per value, one column per family."""
    columns = families()
    names: list[str] = []
    for _, family in columns:
        for name in _values(family):
            if name not in names:
                names.append(name)
    header = "| value | " + " | ".join(name for name, _ in columns) + " |"
    lines = [header, "|---|" + "---|" * len(columns)]
    for name in names:
        cells = [_cell(_values(family).get(name)) for _, family in columns]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def replace_in(page: str) -> str:
    """`page` with the text between the support-table markers replaced by the current table."""
    begin, end = MARKERS
    if begin not in page or end not in page:
        raise ValueError(f"the page has no {begin} ... {end} section to fill")
    head, rest = page.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{support_table()}\n{end}{tail}"


def main() -> None:
    """`python -m vllm_envoys.support_table PAGE`: refresh the table in a docs page."""
    import sys
    from pathlib import Path

    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m vllm_envoys.support_table docs/vllm-envoys.md")
    page = Path(sys.argv[1])
    page.write_text(replace_in(page.read_text()))
    print(f"updated the support table in {page}")


if __name__ == "__main__":
    main()
