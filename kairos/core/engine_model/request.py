"""Mutable per-request state of the engine model; never leaves :class:`kairos.core.engine_model.core.Engine`."""

from __future__ import annotations

import operator
from dataclasses import dataclass

from kairos.core.engine_model.types import EngineError
from kairos.core.vocabulary import RequestPhase, RequestRole

# request kinds: the node's part of the path (kairos.core.vocabulary.RequestRole)
PREFILL, REMOTE, DEFLECT = RequestRole.PREFILL, RequestRole.REMOTE_DECODE, RequestRole.DEFLECT
# request phases (kairos.core.vocabulary.RequestPhase; each names the engine's container that holds the request)
WAITING, PREFILLING, DEFLECTING = RequestPhase.WAITING, RequestPhase.PREFILLING, RequestPhase.DEFLECTED_PREFILL
AWAIT_KV, READY, DECODING = RequestPhase.AWAITING_KV, RequestPhase.READY, RequestPhase.DECODING
HELD, GONE = RequestPhase.HELD, RequestPhase.GONE


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
    kind: RequestRole  #: PREFILL, REMOTE or DEFLECT
    prompt: int  #: prompt tokens
    output: int  #: output tokens to emit (0 on prefill nodes unless they also decode: PD aggregation)
    blocks: int  #: KV blocks reserved at admission
    schedule: tuple[int, ...] = ()  #: deflected: χ per prefill step (total step tokens)
    phase: RequestPhase = WAITING
    computed: int = 0  #: prompt tokens computed on this node
    generated: int = 0  #: output tokens emitted
    steps: int = 0  #: prefill steps run
    hashes: tuple[int, ...] = ()  #: prefix-cache hashes of the prompt's full blocks
    hit: int = 0  #: prompt tokens served from this node's prefix cache at admission
    pinned: list[int] | None = None  #: cache hashes this request pins (released when it leaves)
