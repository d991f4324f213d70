"""Which senders the ingress accepts out events from, per attempt of a request (no I/O).

Out events travel on ``kairos.out.<bus request id>.<sender user>`` and the bus lets each NATS user
publish only under its own name (:mod:`kairos.contracts.permissions`), so the subject proves the sender. The
ingress accepts an attempt's events only from:

* **the node its job went to**: the ingress sends every job itself (kairos/services/ingress/jobrelay.py)
  and accepts the node that accepted it;
* **on the keep path, the decode node the prefill node handed the KV to**: when a decode node has
  accepted the KV, the prefill node (proven as above) names it in a
  :class:`~kairos.contracts.events.HandoffEvent` on its own out subject (candidates that refused are never
  named);
* **a dispatcher** (user ``dispatcher``), for error events only (routing failures, e.g.
  ``no_available_node``).

An event from another agent is *held* (at most :data:`HOLD_MAX` per attempt), not refused at once:
a node's first token may overtake its answer to the job (the answer comes on the ingress's reply
inbox, the tokens on their out subject: nats-py runs each subscription's callbacks in its own task,
so even messages sent in order on one connection may be handled out of order here), and a decode node's may overtake the
prefill node's handoff event (sent after the decode node's answer). Held events are replayed when their sender is accepted, and refused (counted as forged,
``forged_message_refused``) once the attempt streams from its node, moves to a new attempt (a lost
node's re-submission: a new bus id, a new set of senders) or ends. Events whose body names another
node than the subject (``node`` of tokens, done and handoff events; ``source`` of errors) are
refused at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kairos.core.vocabulary import KEEP, PathKind
from kairos.contracts.permissions import AGENT_PREFIX, DISPATCHER
from kairos.contracts.events import ErrorEvent, HandoffEvent, OutEvent

#: out events held per attempt while their sender is not (yet) accepted; more are refused at once
HOLD_MAX = 64
#: the ``source`` of an ErrorEvent an agent sends (``node_agent:<node>``)
AGENT_SOURCE = "node_agent:"


@dataclass(frozen=True)
class Held:
    """An out event whose sender is not accepted (yet): ``subject`` (where it came), ``node`` (the
    agent's node id the subject proves)."""

    subject: str
    node: str
    event: OutEvent


@dataclass
class Senders:
    """The accepted senders of one attempt (rules in the module docstring).

    Args:
        attempt_id: the bus request id whose events are judged.
    """

    attempt_id: str
    nodes: set[str] = field(default_factory=set)  #: agents whose events are accepted
    prefill_nodes: set[str] = field(default_factory=set)  #: routed keep-path nodes: may name decode nodes
    held: list[Held] = field(default_factory=list)

    def routed(self, node: str, kind: PathKind) -> None:
        """``node`` accepted this attempt's ``kind`` job (sent by this ingress)."""
        self.nodes.add(node)
        if kind == KEEP:
            self.prefill_nodes.add(node)

    def judge(self, subject: str, sender: str, ev: OutEvent) -> str | None:
        """Why ``ev`` (from NATS user ``sender``, on ``subject``) is refused now, ``"held"`` if it
        waits for its sender to be accepted, or None: accepted (a handoff event has then added its
        decode node: call :meth:`release` for the events that were waiting for it)."""
        if sender == DISPATCHER:
            return None if isinstance(ev, ErrorEvent) else "dispatcher_sends_only_errors"
        if not sender.startswith(AGENT_PREFIX):
            return "not_a_node"
        node = sender[len(AGENT_PREFIX):]
        claimed = ev.source.removeprefix(AGENT_SOURCE) if isinstance(ev, ErrorEvent) else ev.node
        if claimed != node:
            return "names_another_node"
        if node in self.nodes:
            return self._accept(node, ev)
        if len(self.held) >= HOLD_MAX:
            return "not_the_jobs_node"
        self.held.append(Held(subject, node, ev))
        return "held"

    def _accept(self, node: str, ev: OutEvent) -> str | None:
        if isinstance(ev, HandoffEvent):
            if node not in self.prefill_nodes:
                return "not_the_prefill_node"
            self.nodes.add(ev.decode_node)
        return None

    def release(self) -> tuple[list[OutEvent], list[tuple[Held, str]]]:
        """Held events whose sender is accepted now, each sender's in arrival order (handoff events
        among them accepting more senders, whose events follow), and those refused on the way (with
        why); both leave the hold."""
        out: list[OutEvent] = []
        refused: list[tuple[Held, str]] = []
        while any(h.node in self.nodes for h in self.held):
            keep: list[Held] = []
            waiting: set[str] = set()  # a node whose earlier event waits: its later ones wait too (order)
            for h in self.held:
                if h.node not in self.nodes or h.node in waiting:
                    keep.append(h)
                    waiting.add(h.node)
                elif (why := self._accept(h.node, h.event)) is None:
                    out.append(h.event)
                else:
                    refused.append((h, why))
            self.held = keep
        return out, refused

    def refuse_held(self) -> list[Held]:
        """Give up waiting: every held event (to count and log as forged)."""
        out, self.held = self.held, []
        return out
