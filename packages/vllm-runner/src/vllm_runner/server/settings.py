"""The operator's settings of `vllm-interp serve`: its `--interp-*` options, which travel to the
API server process as environment variables (vLLM's own parser refuses options it does not
know, and the server process is vLLM's).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: option -> (variable, whether it takes a value)
OPTIONS: dict[str, tuple[str, bool]] = {
    "--interp-allow-code": ("VLLM_INTERP_SERVE_ALLOW_CODE", False),
    "--interp-vectors": ("VLLM_INTERP_SERVE_VECTORS", True),
    "--interp-default": ("VLLM_INTERP_SERVE_DEFAULT", True),
    "--interp-max-locations": ("VLLM_INTERP_SERVE_MAX_LOCATIONS", True),
    "--interp-max-saved-mib": ("VLLM_INTERP_SERVE_MAX_SAVED_MIB", True),
    "--interp-inline-mib": ("VLLM_INTERP_SERVE_INLINE_MIB", True),
    "--interp-saves-budget-mib": ("VLLM_INTERP_SERVE_SAVES_BUDGET_MIB", True),
    "--interp-saves-ttl-s": ("VLLM_INTERP_SERVE_SAVES_TTL_S", True),
}
#: Options that set the engine's taps (`LLM(taps=, graph_taps=)`), in this order: they travel in
#: vLLM's `--additional-config` (`server.command.with_additional_config`), not in the environment.
TAP_OPTIONS = ("--interp-taps", "--interp-graph-taps")
#: The option that loads an SAE (`LLM(saes=...)`), once per SAE: `--interp-sae NAME=PATH`; it
#: travels in vLLM's `--additional-config` too.
SAE_OPTION = "--interp-sae"
#: The defaults of the options with a number: (value, smallest allowed).
NUMBERS: dict[str, tuple[float, float]] = {
    "--interp-max-locations": (256, 1),
    "--interp-max-saved-mib": (1024, 0),
    "--interp-inline-mib": (1, 0),
    "--interp-saves-budget-mib": (1024, 0),
    "--interp-saves-ttl-s": (600, 1),
}
DEFAULT_VECTORS = Path("~/.cache/vllm-interp/vectors")


def option_value(name: str, has_value: str, value: str, pending: list[str]) -> str:
    """An option's value, given as `NAME=VALUE` (`option.partition("=")`) or as the next
    argument, which is then taken from `pending`; an option without one is refused by name."""
    if has_value:
        return value
    if not pending:
        raise ValueError(f"{name} needs a value")
    return pending.pop(0)


def split_options(options: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """(the options for `vllm serve`, the environment our `--interp-*` options set); an
    `--interp-*` option we do not know is refused by name (vLLM would refuse it less clearly)."""
    passed: list[str] = []
    environment: dict[str, str] = {}
    pending = list(options)
    while pending:
        option = pending.pop(0)
        name, has_value, value = option.partition("=")
        if not name.startswith("--interp-"):
            passed.append(option)
            continue
        if name not in OPTIONS:
            raise ValueError(f"unknown option {name}; vllm-interp serve takes "
                             f"{', '.join([*OPTIONS, *TAP_OPTIONS, SAE_OPTION])} besides vllm "
                             "serve's own")
        variable, takes_value = OPTIONS[name]
        if not takes_value:
            if has_value:
                raise ValueError(f"{name} takes no value")
            environment[variable] = "1"
            continue
        environment[variable] = option_value(name, has_value, value, pending)
    return passed, environment


@dataclass(frozen=True)
class ServerSettings:
    """What the routes read, from the environment `split_options` set."""

    allow_code: bool
    vectors: Path
    default: list[Any] | None
    max_locations: int
    #: The most a request's saves may take (bounded before it is queued: `saved_bytes_bound`).
    max_saved_bytes: int
    #: Saves up to this many bytes come back in the response; larger ones are kept under an id
    #: (unless the request asks for one or the other: `interp_saves`).
    inline_bytes: int
    saves_budget_bytes: int
    saves_ttl_s: float

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> ServerSettings:
        """The settings, checked; a bad one stops the server before it serves anything."""
        def value(option: str) -> str | None:
            return environ.get(OPTIONS[option][0])

        default = None
        if (path := value("--interp-default")) is not None:
            try:
                default = json.loads(Path(path).expanduser().read_text())
            except (OSError, ValueError) as error:
                raise ValueError(f"--interp-default {path}: not a readable JSON file of "
                                 f"interventions ({error})") from None
        numbers = {option: _number(option, value(option)) for option in NUMBERS}
        return cls(allow_code=value("--interp-allow-code") == "1",
                   vectors=Path(value("--interp-vectors") or DEFAULT_VECTORS).expanduser(),
                   default=default, max_locations=int(numbers["--interp-max-locations"]),
                   max_saved_bytes=int(numbers["--interp-max-saved-mib"] * 2**20),
                   inline_bytes=int(numbers["--interp-inline-mib"] * 2**20),
                   saves_budget_bytes=int(numbers["--interp-saves-budget-mib"] * 2**20),
                   saves_ttl_s=numbers["--interp-saves-ttl-s"])


def _number(option: str, given: str | None) -> float:
    default, smallest = NUMBERS[option]
    if given is None:
        return default
    try:
        number = float(given)
    except ValueError:
        number = smallest - 1
    whole = option == "--interp-max-locations"
    if number < smallest or (whole and not number.is_integer()):
        kind = "a whole number" if whole else "a number"
        raise ValueError(f"{option} {given}: {kind}, {smallest:g} or more")
    return number
