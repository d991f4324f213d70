"""One vocabulary for where a request goes: the path names used end to end.

A request takes one of two paths (paper §4, Algorithm 1):

* ``keep`` — the P/D path: prefill on a prefill node, then the KV cache is handed to a decode node;
* ``deflect`` — the decode node itself runs the prefill as chunked-prefill steps interleaved with
  its decodes (the chunk schedule χ_1..χ_m of Eq. 5), then decodes.

:data:`PathKind` is the one name for that choice in the policy's :class:`~kairos.core.policy.base.Decision`,
the wire messages (``Job``, ``RoutedEvent``, ``DecodeTiming``, schema v2), the ingress's
request lifecycle, the node agent, span attributes and metric labels. Wire schema v1 called the keep
path ``prefill``; :func:`path_kind` still reads that name for one release (a rolling upgrade's old
producers).

Where a request is *on one node* is :class:`RequestPhase`, and what that node does for it is
:class:`RequestRole` (its part of the path): one vocabulary for the engine model
(:mod:`kairos.core.engine_model`), both engine backends (:mod:`kairos.engines`) and the node agent's request
lifecycle (:mod:`kairos.services.node_agent.request`)::

    role           phases on the node (each component uses the ones it can see)
    prefill        waiting → prefilling → held → handed_off → gone           (keep path, prefill node)
    remote_decode  waiting → awaiting_kv → ready → decoding → gone           (keep path, decode node)
    deflect        waiting → deflected_prefill → decoding → gone             (deflect path, decode node)

Pure: no I/O, no third-party imports.
"""

from __future__ import annotations

import enum
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


class RequestPhase(enum.StrEnum):
    """Where one request is on one node (the module docstring draws the order per role).

    A :class:`~enum.StrEnum`: each member equals its name on the wire, in logs and in
    ``EngineBackend.phase()`` answers (``RequestPhase.HELD == "held"``). The engine model uses every
    phase but ``handed_off``; the vLLM backend the ones its HTTP requests show (``prefilling``,
    ``held``, ``awaiting_kv``, ``deflected_prefill``, ``decoding``); the node agent's request
    lifecycle all but ``ready`` (an engine-internal wait for a running slot).
    """

    WAITING = "waiting"  #: queued for KV blocks and a running slot (vLLM ``RequestStatus.WAITING``)
    PREFILLING = "prefilling"  #: keep path, prefill node: the prompt is being computed
    DEFLECTED_PREFILL = "deflected_prefill"  #: deflect path: chunked prefill on the decode node (Eq. 5's χ steps)
    AWAITING_KV = "awaiting_kv"  #: keep path, decode node: blocks allocated, the KV cache is being pulled
    READY = "ready"  #: the KV cache arrived, no running slot yet (engine model)
    DECODING = "decoding"  #: emitting output tokens, one per step
    HELD = "held"  #: keep path, prefill node: prompt computed, its KV kept for the decode node
    HANDED_OFF = "handed_off"  #: node agent: a decode node took the KV; blocks kept until it says it pulled them
    GONE = "gone"  #: finished, released, cancelled or failed: nothing of it is left on the node


class RequestRole(enum.StrEnum):
    """What one node does for a request: its part of the request's path (:data:`PathKind`)."""

    PREFILL = "prefill"  #: keep path, prefill node: compute the prompt, hold its KV for the handoff
    REMOTE_DECODE = "remote_decode"  #: keep path, decode node: pull the KV cache, then decode
    DEFLECT = "deflect"  #: deflect path, decode node: chunked prefill, then decode

    @property
    def path(self) -> PathKind:
        """The path this part belongs to (``keep`` or ``deflect``)."""
        return DEFLECT if self is RequestRole.DEFLECT else KEEP

    @property
    def node_role(self) -> Literal["prefill", "decode"]:
        """The role of the node that plays it (``EngineConfig.role``, ``AgentConfig.role``)."""
        return "prefill" if self is RequestRole.PREFILL else "decode"


def job_role(path: PathKind) -> RequestRole:
    """The part a node accepting a job of ``path`` plays: the keep path's job goes to its prefill
    node, a deflect job to the decode node that prefills it (the keep path's decode node gets a
    KV handoff, never a job)."""
    return RequestRole.DEFLECT if path == DEFLECT else RequestRole.PREFILL
