"""The `vllm-interp` command: `demo`, `extract`, `support`.

Each subcommand starts an engine (the embedded default model unless `--model` names one), so
argument errors are reported before that slow part.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="model name or folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="tensor-parallel ranks (default: 1)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt plus generation, in tokens (default: the model's)")
    parser.add_argument("--verbose", action="store_true",
                        help="show vLLM's own log (engine configuration, loading)")
    parser.add_argument("--dtype", default=None,
                        choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights and activations (default: vLLM's choice for the model; "
                             "float32 for the embedded model)")


def _positions(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"positions are comma-separated integers (negative: from the end of the prompt), "
            f"not {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `vllm-interp` and its subcommands."""
    parser = argparse.ArgumentParser(
        prog="vllm-interp",
        description="Interpretability inside vLLM: read and edit a model's internal values per "
                    "request, at engine speed.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo", help="steering, a logit lens and an attention pattern on the default model",
        description="Steer generations with a direction built from contrastive prompts, print a "
                    "logit-lens table, and write PNG figures (logit lens, attention pattern).")
    _engine_arguments(demo)
    demo.add_argument("--out", type=Path, default=Path("vllm-interp-demo"),
                      help="folder for the figures (default: ./vllm-interp-demo)")

    extract = commands.add_parser(
        "extract", help="save values for many prompts to disk (sharded, resumable)",
        description="Run prompts through the engine and stream the values at LOCATIONS to "
                    "safetensors shards with a manifest. Run it again with the same arguments "
                    "to resume after an interruption.")
    _engine_arguments(extract)
    extract.add_argument("--prompts", type=Path, required=True,
                         help="a text file (one prompt per line) or JSONL ('prompt' field)")
    extract.add_argument("--save", required=True,
                         help="comma-separated locations, e.g. 'layers.*.layer_output,logits'")
    extract.add_argument("--out", type=Path, required=True, help="output folder")
    extract.add_argument("--positions", type=_positions, default=None,
                         help="keep only these positions, e.g. '-1' for each prompt's last token")
    extract.add_argument("--shard-size", type=int, default=64,
                         help="prompts per shard (default: 64); memory holds one shard")

    support = commands.add_parser(
        "support", help="which values the model serves, per layer",
        description="Print the value x layer availability table of a model, with reasons.")
    _engine_arguments(support)
    return parser


def _llm(arguments: argparse.Namespace, **engine: Any) -> Any:
    from vllm_runner.llm import LLM

    for name in ("max_model_len", "dtype"):
        if getattr(arguments, name) is not None:
            engine[name] = getattr(arguments, name)
    return LLM(arguments.model, tensor_parallel_size=arguments.tensor_parallel_size, **engine)


def support_table(support: dict[str, str | None]) -> str:
    """The availability table: one line per value, the layers that serve it, and reasons."""
    by_value: dict[str, dict[str, list[int]]] = {}
    for location, reason in support.items():
        parts = location.split(".")
        layer = int(parts[1]) if parts[0] == "layers" else -1
        name = ".".join(parts[2:]) if layer >= 0 else location
        by_value.setdefault(name, {}).setdefault(reason or "", []).append(layer)
    lines = [f"{'value':<42} available"]
    for name, reasons in by_value.items():
        served = sorted(reasons.pop("", []))
        where = "model" if served == [-1] else _ranges(served) if served else "-"
        lines.append(f"{name:<42} {where}")
        for reason, layers in reasons.items():
            scope = "" if layers == [-1] else f"layers {_ranges(sorted(layers))}: "
            lines.append(f"{'':<42}   not {scope}{reason}")
    return "\n".join(lines)


def _ranges(layers: list[int]) -> str:
    spans: list[str] = []
    start = previous = layers[0]
    for layer in [*layers[1:], None]:
        if layer is not None and layer == previous + 1:
            previous = layer
            continue
        spans.append(f"{start}" if start == previous else f"{start}-{previous}")
        if layer is not None:
            start = previous = layer
    return ",".join(spans)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `vllm-interp` command."""
    arguments = build_parser().parse_args(argv)
    if not arguments.verbose:
        # vLLM logs its configuration to stdout at INFO; a command's output should be its own.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if arguments.command == "support":
        print(support_table(_llm(arguments).support()))
        return 0
    if arguments.command == "extract":
        from vllm_runner.extract import extract, read_prompts

        if arguments.shard_size < 1:
            raise SystemExit("vllm-interp extract: --shard-size must be at least 1")
        prompts = read_prompts(arguments.prompts)
        if not prompts:
            raise SystemExit(f"vllm-interp extract: {arguments.prompts} holds no prompts")
        locations = [part.strip() for part in arguments.save.split(",") if part.strip()]
        llm = _llm(arguments)
        out = extract(llm, prompts, locations, arguments.out, positions=arguments.positions,
                      shard_size=arguments.shard_size, model_name=arguments.model or "default")
        print(f"wrote {len(prompts)} prompts to {out}")
        return 0
    from vllm_runner.demo import run_demo

    run_demo(_llm(arguments), arguments.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
