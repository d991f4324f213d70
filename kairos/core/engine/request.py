"""Mutable per-request state of the engine model; never leaves :class:`kairos.core.engine.core.Engine`."""

from __future__ import annotations

import operator
from dataclasses import dataclass

from kairos.core.engine.types import EngineError

# request kinds
PREFILL, REMOTE, DEFLECT = 0, 1, 2
# request phases (an index into the engine's per-phase containers)
WAITING, PREFILLING, DEFLECTING, AWAIT_KV, READY, DECODING, HELD, GONE = range(8)
PHASE_NAMES = ("waiting", "prefilling", "deflected_prefill", "awaiting_kv", "ready", "decoding", "held", "gone")


def as_count(req_id: str, name: str, v: object) -> int:
    """``v`` as a Python int (numpy integers accepted), else :class:`EngineError`."""
    try:
        return operator.index(v)  # type: ignore[arg-type]
    except TypeError:
        raise EngineError(f"{req_id!r}: {name} must be an integer, got {v!r}") from None


@dataclass(slots=True, eq=False)
class Req:
    """One request on one engine (compared by identity, so a re-added id is a different request)."""

    id: str
    kind: int  #: PREFILL, REMOTE or DEFLECT
    prompt: int  #: prompt tokens
    output: int  #: output tokens to emit (0 on prefill nodes unless they also decode: PD aggregation)
    blocks: int  #: KV blocks reserved at admission
    schedule: tuple[int, ...] = ()  #: deflected: χ per prefill step (total step tokens)
    phase: int = WAITING
    computed: int = 0  #: prompt tokens computed on this node
    generated: int = 0  #: output tokens emitted
    steps: int = 0  #: prefill steps run
    hashes: tuple[int, ...] = ()  #: prefix-cache hashes of the prompt's full blocks
    hit: int = 0  #: prompt tokens served from this node's prefix cache at admission
    pinned: list[int] | None = None  #: cache hashes this request pins (released when it leaves)
