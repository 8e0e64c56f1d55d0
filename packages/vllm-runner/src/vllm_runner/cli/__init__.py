"""The `vllm-interp` command: `demo`, `extract`, `support`, `serve`.

Each subcommand starts an engine (the embedded default model unless `--model` names one), so
argument errors are reported before that slow part.
"""

from __future__ import annotations

import argparse
import json
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
    parser.add_argument("--gpu-memory-utilization", type=_fraction, default=None,
                        help="the share of the GPU's memory (on a CPU: of the NUMA node's) vLLM "
                             "may take (default on a GPU: vLLM's 0.92; on a CPU a KV cache that "
                             "fits is chosen)")
    parser.add_argument("--kv-cache-memory-bytes", type=_whole, default=None,
                        help="the KV cache's size per rank in bytes (overrides "
                             "--gpu-memory-utilization)")
    parser.add_argument("--dtype", default=None,
                        choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights and activations (default: vLLM's choice for the model; "
                             "float32 for the embedded model)")
    parser.add_argument("--engine-arg", action="append", default=[], type=_engine_arg,
                        metavar="NAME=VALUE",
                        help="any other vLLM engine argument, repeatable, e.g. --engine-arg "
                             "max_num_seqs=16 --engine-arg enable_prefix_caching=false (VALUE "
                             "is read as JSON, else as text)")
    parser.add_argument("--verbose", action="store_true",
                        help="show vLLM's own log on stderr (engine configuration, loading)")


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], not {text!r}")
    return value


def _whole(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of bytes, not {text!r}")
    return value


def _engine_arg(text: str) -> tuple[str, Any]:
    name, equals, value = text.partition("=")
    name = name.strip().replace("-", "_")
    if not equals or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE (e.g. max_num_seqs=16), not "
                                         f"{text!r}")
    try:
        return name, json.loads(value)
    except ValueError:
        return name, value


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
    extract.add_argument("--save", default="",
                         help="comma-separated locations, e.g. 'layers.*.layer_output,logits'")
    extract.add_argument("--sae", action="append", default=[], metavar="NAME=PATH[@SITE]",
                         help="an SAE (its folder or file) whose features to extract, sparse; "
                              "@SITE names the site for files that name none (Gemma Scope's "
                              "params.npz), e.g. @blocks.12.hook_resid_post; repeat for more")
    extract.add_argument("--top-k", type=int, default=None,
                         help="features kept per token and SAE (default: every active one, "
                              "as many as each prompt's busiest token has; slower on SAEs "
                              "other than TopK)")
    extract.add_argument("--out", required=True,
                         help="output folder, or any fsspec URL (s3://bucket/prefix with s3fs, "
                              "gs://... with gcsfs)")
    extract.add_argument("--positions", type=_positions, default=None,
                         help="keep only these positions, e.g. '-1' for each prompt's last token")
    extract.add_argument("--shard-size", type=int, default=64,
                         help="prompts per shard (default: 64); memory holds one shard")
    extract.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                         help="spread the prompts over engine replicas on a Ray cluster (needs "
                              "vllm-runner[ray]): the one at ADDRESS (e.g. ray://head:10001), "
                              "else RAY_ADDRESS's or a `ray start` on this machine, else a new "
                              "one here; each replica writes its shards to --out")
    extract.add_argument("--replicas", type=int, default=None,
                         help="engine replicas with --ray (default: 1)")
    extract.add_argument("--replica-cpus", type=float, default=1.0,
                         help="CPUs Ray reserves for each replica (default: 1)")
    extract.add_argument("--replica-gpus", type=float, default=0.0,
                         help="GPUs Ray reserves for each replica: its engine's ranks, e.g. "
                              "--tensor-parallel-size (default: 0)")

    support = commands.add_parser(
        "support", help="which values the model serves, per layer",
        description="Print the value x layer availability table of a model, with reasons.")
    _engine_arguments(support)

    serve = commands.add_parser(
        "serve", help="vLLM's OpenAI-compatible server with per-request interventions",
        usage="vllm-interp serve [MODEL] [vllm serve options] [--interp-* options]",
        description="Run `vllm serve MODEL OPTIONS` with the interpretability worker and routes: "
                    "/v1/completions and /v1/chat/completions take an `interventions` field. "
                    "Without MODEL, the embedded SmolLM2-135M-Instruct is served. Every `vllm "
                    "serve` option works as there (see `vllm serve --help`); the operator's "
                    "options: --interp-vectors DIR (named vectors, default "
                    "~/.cache/vllm-interp/vectors), --interp-default PROGRAM.json (the program "
                    "of requests that bring none), --interp-max-locations N (default 256), "
                    "--interp-max-saved-mib N (the most one request's saves may take, "
                    "bounded before it is queued; default 1024), "
                    "--interp-inline-mib N (larger saves are kept under an id; default 1), "
                    "--interp-saves-budget-mib N (all kept saves; default 1024), "
                    "--interp-saves-ttl-s N (default 600), --interp-allow-code (accept `call` "
                    "ops: runs clients' pickled code).")
    serve.add_argument("options", nargs=argparse.REMAINDER,
                       help="[MODEL] and any `vllm serve` options, passed on as given")
    return parser


def _llm(arguments: argparse.Namespace,
         saes: dict[str, str | tuple[str, str]] | None = None) -> Any:
    from vllm_runner.client.llm import LLM

    return LLM(arguments.model, **_engine(arguments, saes))


def _engine(arguments: argparse.Namespace,
            saes: dict[str, str | tuple[str, str]] | None = None) -> dict[str, Any]:
    """The engine arguments of `LLM` the command's options give (the model aside)."""
    engine: dict[str, Any] = dict(arguments.engine_arg)
    # Every request of these commands runs a program at locations no tap serves, so a compiled
    # engine would run each step uncompiled after minutes of compiling and graph capture:
    # eager unless the user asks.
    engine.setdefault("enforce_eager", True)
    for name in ("max_model_len", "dtype", "gpu_memory_utilization", "kv_cache_memory_bytes"):
        if getattr(arguments, name) is not None:
            engine[name] = getattr(arguments, name)
    if saes:
        engine["saes"] = saes
    engine["tensor_parallel_size"] = arguments.tensor_parallel_size
    return engine


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
    """Entry point of the `vllm-interp` command: exit 0 when done, 1 when the work failed, 2 for
    bad arguments (found before the engine starts where possible), 130 on Ctrl-C."""
    given = list(sys.argv[1:] if argv is None else argv)
    if given[:1] == ["serve"] and given[1:2] not in (["-h"], ["--help"]):
        # Everything after `serve` is vLLM's to parse (argparse would take its options for
        # ours); vLLM's server logs and exit status are its own.
        from vllm_runner.errors import UnsupportedEngine
        from vllm_runner.server.command import run_serve

        try:
            run_serve(given[1:])
        except (ValueError, UnsupportedEngine) as error:
            print(f"vllm-interp serve: {error}", file=sys.stderr)
            return 2
        return 0
    parser = build_parser()
    arguments = parser.parse_args(given)
    # vLLM logs to stdout at INFO by default; a command's output should be its own. Set before
    # vLLM is first imported (it configures its logging then) and inherited by its processes.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if not arguments.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from vllm_runner.errors import InterpError, LocationError

    try:
        return _run(parser, arguments)
    except KeyboardInterrupt:
        return _interrupted(arguments.command)
    except Exception as error:
        if _raised_while_interrupting(error):
            return _interrupted(arguments.command)
        if arguments.verbose or not isinstance(error, (InterpError, ValueError, OSError)):
            raise  # the whole traceback: a bug of ours, or asked for one for a bug report
        message = str(error).strip() or type(error).__name__
        print(f"vllm-interp {arguments.command}: {message}", file=sys.stderr)
        return 2 if isinstance(error, LocationError) else 1


def _interrupted(command: str) -> int:
    """Say in one line that Ctrl-C stopped `command` (and how to resume an extraction); 130 is
    the shell's code for a process ended by SIGINT."""
    again = (" Run the same command again to resume: finished shards are kept."
             if command == "extract" else "")
    print(f"vllm-interp {command}: interrupted.{again}", file=sys.stderr)
    return 130


def _raised_while_interrupting(error: BaseException) -> bool:
    """Whether `error` was raised while a `KeyboardInterrupt` was being handled, and so hides it.

    Code that cleans up in a `finally` can fail when Ctrl-C lands at the wrong instruction:
    vLLM 0.32's tokenizer pool (`vllm/tokenizers/hf.py`) then puts back a tokenizer it never got
    and raises `UnboundLocalError`, seen in CI when Ctrl-C reached `extract` as it added
    requests. The user pressed Ctrl-C; they should see the one-line interruption, not that
    traceback."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


def _run(parser: argparse.ArgumentParser, arguments: argparse.Namespace) -> int:
    if arguments.command == "support":
        print(support_table(_llm(arguments).support()))
        return 0
    if arguments.command == "extract":
        return _extract(parser, arguments)
    from vllm_runner.cli.demo import run_demo

    run_demo(_llm(arguments), arguments.out)
    return 0


def _extract(parser: argparse.ArgumentParser, arguments: argparse.Namespace) -> int:
    from vllm_runner.cli.extract import ExtractionMismatch, extract, read_prompts, resumable
    from vllm_runner.settings import sae_option

    if arguments.shard_size < 1:
        parser.error("--shard-size must be at least 1")
    try:
        prompts = read_prompts(arguments.prompts)
    except (OSError, ValueError) as error:
        parser.error(f"--prompts: {error}")
    if not prompts:
        parser.error(f"--prompts: {arguments.prompts} holds no prompts")
    locations = [part.strip() for part in arguments.save.split(",") if part.strip()]
    saes: dict[str, str | tuple[str, str]] = {}
    for given in arguments.sae:
        try:
            name, spec = sae_option(given, "--sae")
        except ValueError as error:
            parser.error(str(error))
        saes[name] = spec
    if not locations and not saes:
        parser.error("give --save LOCATIONS, --sae NAME=PATH, or both")
    if arguments.top_k is not None and arguments.top_k < 1:
        parser.error("--top-k must be at least 1")
    if arguments.ray is None and arguments.replicas is not None:
        parser.error("--replicas needs --ray (the replicas run on a Ray cluster)")
    if arguments.replicas is not None and arguments.replicas < 1:
        parser.error("--replicas must be at least 1")
    settings: dict[str, Any] = dict(
        positions=arguments.positions, shard_size=arguments.shard_size,
        model_name=arguments.model or "default",
        features={name: arguments.top_k for name in saes})
    try:  # before the engine's slow start
        resumable(arguments.out, prompts, locations, **settings)
    except ExtractionMismatch as error:
        parser.error(str(error))
    if arguments.ray is not None:
        from vllm_runner.cli.extract_ray import extract_on_ray

        out = extract_on_ray(prompts, locations, arguments.out, model=arguments.model,
                             engine=_engine(arguments, saes), replicas=arguments.replicas or 1,
                             address=arguments.ray or None, replica_cpus=arguments.replica_cpus,
                             replica_gpus=arguments.replica_gpus, **settings)
    else:
        out = extract(_llm(arguments, saes), prompts, locations, arguments.out, **settings)
    print(f"wrote {len(prompts)} prompts to {out}")
    return 0
