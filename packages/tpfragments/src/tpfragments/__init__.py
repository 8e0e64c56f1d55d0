"""tpfragments: a value one tensor-parallel rank holds a piece of, made whole once per visit and
cut back exactly.

Under tensor parallelism most interesting values inside a model (queries, keys, values, MLP
neurons, per-rank heads, partial sums) exist only as pieces spread over ranks. `tpfragments`
owns the math that turns a rank's piece into the whole value and an edited whole back into the
rank's piece, with the engine's exact layouts, one collective per visit and bit-for-bit
exactness when nothing was edited. It depends on torch only; `tpfragments.vllm` maps vLLM's
tensor-parallel layers onto rules and imports vLLM only when called.
"""

from importlib.metadata import PackageNotFoundError, version

from .errors import (
    FragmentError,
    GroupSizeError,
    PieceShapeError,
    UnknownLocationError,
    UnsupportedLayerError,
    WholeShapeError,
)
from .fragments import Back, Entry, Fragments
from .group import AllGather, AllReduce, Group
from .rules import Item, Partial, Replicated, Rule
from .sharding import Part, Shard, Stacked

try:
    __version__ = version("tpfragments")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "AllGather",
    "AllReduce",
    "Back",
    "Entry",
    "FragmentError",
    "Fragments",
    "Group",
    "GroupSizeError",
    "Item",
    "Part",
    "Partial",
    "PieceShapeError",
    "Replicated",
    "Rule",
    "Shard",
    "Stacked",
    "UnknownLocationError",
    "UnsupportedLayerError",
    "WholeShapeError",
]
