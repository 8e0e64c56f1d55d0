"""tokenspan: a request's rows in a flat, continuously batched token slab.

Engines with continuous batching run many requests' tokens as one slab of rows. tokenspan
says which rows belong to which request (`StepLayout`, `Span`), finds the token axis of a value
(`token_axis`), takes a request's rows out (`narrow`), puts replaced rows back (`widen`), lends
them safely to user code (`lease`, or `lend` for one tensor already taken out), and does all of
that for many requests at once (`StepLayout.select` → `Selection`, with `Selection.reads()`
planning one read per run of adjacent requests: `RunRead`). It depends on torch alone and knows
no engine.
"""

from importlib.metadata import PackageNotFoundError, version

from tokenspan.axis import token_axis
from tokenspan.errors import LayoutError, SpanError, SpanShapeError
from tokenspan.layout import StepLayout
from tokenspan.lease import READ_MODES, Lease, Lent, ReadMode, lease, lend
from tokenspan.narrowing import narrow, widen
from tokenspan.runs import RunRead
from tokenspan.selection import Selection
from tokenspan.span import Span

try:
    __version__ = version("tokenspan")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "READ_MODES",
    "LayoutError",
    "Lease",
    "Lent",
    "ReadMode",
    "RunRead",
    "Selection",
    "Span",
    "SpanError",
    "SpanShapeError",
    "StepLayout",
    "__version__",
    "lease",
    "lend",
    "narrow",
    "token_axis",
    "widen",
]
