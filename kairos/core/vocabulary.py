"""One vocabulary for where a request goes: the path names used end to end.

A request takes one of two paths (paper §4, Algorithm 1):

* ``keep`` — the P/D path: prefill on a prefill node, then the KV cache is handed to a decode node;
* ``deflect`` — the decode node itself runs the prefill as chunked-prefill steps interleaved with
  its decodes (the chunk schedule χ_1..χ_m of Eq. 5), then decodes.

:data:`PathKind` is the one name for that choice in the policy's :class:`~kairos.core.policy.base.Decision`,
the wire messages (``Job``, ``Claim``, ``RoutedEvent``, ``DecodeTiming``, schema v2), the ingress's
request lifecycle, the node agent, span attributes and metric labels. Wire schema v1 called the keep
path ``prefill``; :func:`path_kind` still reads that name for one release (a rolling upgrade's old
producers and claims already stored in a bucket).

Pure: no I/O, no third-party imports.
"""

from __future__ import annotations

from typing import Final, Literal

#: the request's path: ``keep`` (P/D + KV handoff) or ``deflect`` (chunked prefill on the decode node)
PathKind = Literal["keep", "deflect"]
KEEP: Final = "keep"
DEFLECT: Final = "deflect"
#: every path, in the order the docs list them
PATHS: Final[tuple[PathKind, ...]] = (KEEP, DEFLECT)
#: what wire schema v1 sent for the keep path (read as ``keep`` for one release, never written)
LEGACY_KEEP: Final = "prefill"
#: the values a v2 decoder accepts in a ``kind`` field (:func:`path_kind` turns them into a PathKind)
WirePathKind = Literal["keep", "deflect", "prefill"]


def path_kind(value: str) -> PathKind:
    """``value`` as a :data:`PathKind` (``"prefill"``, the v1 name of the keep path, reads as ``keep``).

    Raises:
        ValueError: ``value`` names no path.
    """
    if value == KEEP or value == LEGACY_KEEP:
        return KEEP
    if value == DEFLECT:
        return DEFLECT
    raise ValueError(f"unknown path kind {value!r}: expected one of {', '.join(PATHS)}")
