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
}
DEFAULT_VECTORS = Path("~/.cache/vllm-interp/vectors")
DEFAULT_MAX_LOCATIONS = 256


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
                             f"{', '.join(OPTIONS)} besides vllm serve's own")
        variable, takes_value = OPTIONS[name]
        if not takes_value:
            if has_value:
                raise ValueError(f"{name} takes no value")
            environment[variable] = "1"
            continue
        if not has_value:
            if not pending:
                raise ValueError(f"{name} needs a value")
            value = pending.pop(0)
        environment[variable] = value
    return passed, environment


@dataclass(frozen=True)
class ServerSettings:
    """What the routes read, from the environment `split_options` set."""

    allow_code: bool
    vectors: Path
    default: list[Any] | None
    max_locations: int

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
        limit = value("--interp-max-locations")
        try:
            max_locations = DEFAULT_MAX_LOCATIONS if limit is None else int(limit)
        except ValueError:
            max_locations = 0
        if max_locations < 1:
            raise ValueError(f"--interp-max-locations {limit}: a whole number, 1 or more")
        return cls(allow_code=value("--interp-allow-code") == "1",
                   vectors=Path(value("--interp-vectors") or DEFAULT_VECTORS).expanduser(),
                   default=default, max_locations=max_locations)
