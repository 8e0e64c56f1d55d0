"""`llm.trace(...)`: the same programs written in nnsight's style.

    with llm.trace("The Eiffel Tower is in", max_tokens=8, temperature=0.0) as t:
        h = t.model.layers[3].layer_output.save()
        t.model.layers[5].layer_output.add(vector, scale=4.0)
    h.value            # torch.Tensor [1, positions, hidden]
    t.output           # vLLM's RequestOutput

Nothing runs inside the block: each call on `t.model` appends an op to one request's program,
and leaving the block runs it with `llm.generate` (a bad location is refused then, before the
engine runs anything). A failed program raises `InterventionError` when the block ends.
"""

from __future__ import annotations

from typing import Any

import torch
from tokenspan import ReadMode

from vllm_runner import ops
from vllm_runner.errors import InterventionError


class Saved:
    """What `.save()` (or `.lens()`) hands back: filled in when the trace block ends."""

    def __init__(self, pattern: str, op: ops.Op) -> None:
        self.pattern = pattern
        self._op = op
        self._value: Any = None
        self._ready = False

    @property
    def value(self) -> torch.Tensor | dict[str, torch.Tensor]:
        """The saved tensor (one location), or canonical location → tensor for a pattern such
        as `layers[2:5]` or a lens (its tokens and probabilities)."""
        if not self._ready:
            raise RuntimeError(f"{self.pattern}: the value exists once the `with llm.trace(...)` "
                               "block has ended (nothing runs inside it)")
        return self._value

    def _fill(self, saved: dict[str, torch.Tensor], resolved: list[str]) -> None:
        found = {name: saved[name] for location in resolved
                 for name in self._op.saved_names(location) if name in saved}
        self._value = next(iter(found.values())) if len(found) == 1 else found
        self._ready = True

    def __repr__(self) -> str:
        return f"Saved({self.pattern}{'' if self._ready else ', pending'})"


class Node:
    """A place in the standard tree (`t.model.layers[3].self_attn`) or a value in it
    (`....attention_queries`); methods add ops on it to the trace's program."""

    def __init__(self, trace: Trace, location: str) -> None:
        self._trace = trace
        self._location = location

    def __getattr__(self, name: str) -> Node:
        if name.startswith("_"):
            raise AttributeError(name)
        return Node(self._trace, f"{self._location}.{name}" if self._location else name)

    def __getitem__(self, index: int | slice) -> Node:
        if isinstance(index, slice):
            if index.step not in (None, 1):
                raise ValueError(f"{self._location}[...]: layer slices take no step")
            start = "" if index.start is None else index.start
            stop = "" if index.stop is None else index.stop
            selector = f"{start}:{stop}"
        elif isinstance(index, int):
            selector = str(index)
        else:
            raise TypeError(f"{self._location}[{index!r}]: index layers with an int or a slice")
        return Node(self._trace, f"{self._location}.{selector}")

    def __repr__(self) -> str:
        return f"Node({self._location or 'model'})"

    def save(self, **where: Any) -> Saved:
        """Save this value (see `ops.Save`; `positions=`, `steps=` filter)."""
        return self._trace._saved(ops.Save(self._location, **where))

    def lens(self, top_k: int = 10, **where: Any) -> Saved:
        """Logit-lens this residual value (see `ops.Lens`); the value is a dict of
        `...lens_tokens` and `...lens_probs`."""
        return self._trace._saved(ops.Lens(self._location, top_k, **where))

    def probe(self, weight: torch.Tensor, bias: torch.Tensor | None = None, name: str = "probe",
              **where: Any) -> Saved:
        """A linear probe's scores per token here (see `ops.Probe`)."""
        return self._trace._saved(ops.Probe(self._location, weight, bias, name, **where))

    def add(self, vector: torch.Tensor, scale: float = 1.0, **where: Any) -> None:
        """Add `scale * vector` (see `ops.Add`)."""
        self._trace._ops.append(ops.Add(self._location, vector, scale, **where))

    def set(self, value: torch.Tensor, **where: Any) -> None:
        """Replace the value (see `ops.Set`)."""
        self._trace._ops.append(ops.Set(self._location, value, **where))

    def scale(self, factor: float, **where: Any) -> None:
        """Multiply the value (see `ops.Scale`)."""
        self._trace._ops.append(ops.Scale(self._location, factor, **where))

    def zero(self, heads: tuple[int, ...] | None = None, **where: Any) -> None:
        """Zero the value, or some of its heads (see `ops.Zero`)."""
        self._trace._ops.append(ops.Zero(self._location, heads, **where))

    def project_out(self, direction: torch.Tensor, **where: Any) -> None:
        """Remove the component along `direction` (see `ops.ProjectOut`)."""
        self._trace._ops.append(ops.ProjectOut(self._location, direction, **where))

    def call(self, fn: Any, reads: ReadMode | None = None, rowwise: bool = False) -> None:
        """Run `fn(value, ctx)` in the worker (see `ops.Call`; `rowwise=True`: one call a step
        for all the requests running it)."""
        self._trace._ops.append(ops.Call(self._location, fn, reads, rowwise))

    def skip(self) -> None:
        """Make this layer pass its input through, for this request only (see `ops.Skip`)."""
        parts = self._location.split(".")
        if len(parts) != 2 or parts[0] != "layers" or not parts[1].lstrip("-").isdigit():
            raise ValueError(f"skip() applies to one layer (t.model.layers[3]), not "
                             f"{self._location or 'the model'}")
        self._trace._ops.append(ops.Skip(int(parts[1])))


class Trace:
    """One request, built up inside a `with` block and run when the block ends."""

    def __init__(self, llm: Any, prompt: Any, sampling_params: Any) -> None:
        self._llm = llm
        self._prompt = prompt
        self._params = sampling_params
        self._ops: list[ops.Op] = []
        self._saves: list[Saved] = []
        self.model = Node(self, "")
        self.output: Any = None

    def _saved(self, op: ops.Op) -> Saved:
        self._ops.append(op)
        saved = Saved(op.location, op)
        self._saves.append(saved)
        return saved

    def __enter__(self) -> Trace:
        return self

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        if kind is not None:
            return  # the block failed: run nothing, let its exception through
        # The engine's default program first (nnsight's `edit()`), then the block's ops.
        program = [*getattr(self._llm, "default_interventions", ()), *self._ops]
        (self.output,) = self._llm.generate([self._prompt], self._params,
                                            interventions=[program], use_tqdm=False)
        if self.output.error is not None:
            raise InterventionError(self.output.error)
        resolved = self._llm.resolve([saved.pattern for saved in self._saves])
        for saved in self._saves:
            saved._fill(self.output.saved, resolved[saved.pattern])

    @property
    def saved(self) -> dict[str, torch.Tensor]:
        """Every saved value by canonical location (as `outputs[i].saved`)."""
        return {} if self.output is None else self.output.saved
