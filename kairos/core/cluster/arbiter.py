"""Which node may get an attempt's job: the ingress's arbiter (issue 34; pure, no I/O).

The ingress owns each request (it holds the client's connection) and, on the request path without
JetStream (docs/bus.md, "The request path"), it is the only process that sends a job to a node: a
dispatcher decides and hands the job back; the ingress sends it and tells the dispatcher the node's
answer. At most one node executes an attempt (one bus request id) because this record, one per
attempt, lets a job go out only while no earlier job of the attempt can be running:

* a node that **refused** the job does not run it, nor one the job never reached (**no responders**:
  the server knew no subscriber);
* a node that **accepted** it runs it: every later plan is answered ``cancelled``;
* a node that stayed **silent** (no answer in time: the job, or its answer, may have been lost with a
  server, or the node is frozen) may run it: no other job of this attempt is sent. The attempt
  **moves**: the ingress cancels it and sends the request again under a new attempt id, resuming
  after the tokens the client has (the migration of issue 33).

Two dispatchers may hold one attempt at once (the ingress published it again after the first did not
answer): their plans meet here, one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

#: a node's answer to a job, as the ingress saw it
Answer = Literal["accepted", "refused", "no_responders", "silent"]
#: what the ingress does with a dispatcher's plan: send the job, answer ``cancelled`` (the attempt
#: runs, or has ended), or move the attempt
Verdict = Literal["send", "cancelled", "move"]


class ArbiterError(RuntimeError):
    """An answer recorded for a node the arbiter did not let a job go to."""


@dataclass
class Arbiter:
    """The jobs sent for one attempt, in order, and what each node answered.

    Attributes:
        answers: node → its answer (a node asked twice keeps its last answer).
        pending: the node a job is out to now, None when none (jobs go out one at a time).
        ended: the attempt ended (its client was answered, or it moved): nothing more is sent.
    """

    answers: dict[str, Answer] = field(default_factory=dict)
    pending: str | None = None
    ended: bool = False

    @property
    def running_on(self) -> str | None:
        """The node that accepted the attempt's job, None when none did."""
        return next((n for n, a in self.answers.items() if a == "accepted"), None)

    @property
    def may_run(self) -> set[str]:
        """Nodes that may be running the attempt: the one that accepted it, the silent ones, and
        the one a job is out to now."""
        out = {n for n, a in self.answers.items() if a in ("accepted", "silent")}
        return out | ({self.pending} if self.pending is not None else set())

    def plan(self, node: str) -> Verdict:
        """A dispatcher's plan to send the attempt's job to ``node``: ``send`` (then :meth:`answer`
        must follow), ``cancelled`` (the attempt runs elsewhere, ended, or a job is out now), or
        ``move`` (a silent node may run it: the attempt moves under a new id; it ends here)."""
        if self.ended or self.running_on is not None or self.pending is not None:
            return "cancelled"
        if any(a == "silent" for a in self.answers.values()):
            self.ended = True
            return "move"
        self.pending = node
        return "send"

    def answer(self, node: str, answer: Answer) -> None:
        """``node`` answered the job :meth:`plan` let go to it.

        Raises:
            ArbiterError: no job is out to ``node``.
        """
        if self.pending != node:
            raise ArbiterError(f"no job of this attempt is out to {node!r} (out to: {self.pending!r})")
        self.pending = None
        self.answers[node] = answer

    def end(self) -> None:
        """The attempt ended (answered, failed, cancelled or moved): later plans are ``cancelled``."""
        self.ended = True
