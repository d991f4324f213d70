"""Request lanes and claim buckets: one per NATS cluster member, so that no request waits for a
JetStream leader election (issue 17, part 2).

Why: a replicated stream stops taking messages, and its consumer stops delivering them, from the
moment its raft leader dies until a follower campaigns — 4–9 s later in nats-server (the election
timeout of ``server/raft.go`` is compiled in). With one 3-replica request stream and one claim
bucket, every member kill that took a leader stalled every new request that long
(tests/faults/test_nats_cluster.py). So, in a cluster of N members:

* **request lane i** is the work-queue stream :func:`kairos.contracts.subjects.request_stream` ``(i)`` with
  its dispatchers' consumer, *one* replica placed on member i (server tag
  :func:`kairos.contracts.subjects.lane_tag`): a single-replica stream has no raft group, and stream and
  consumer live and die with their member. The ingress spreads requests over the lanes and moves
  to another at once when a publish finds none (:class:`LanePicker`); every dispatcher pulls from
  every lane. A request queued on a lane whose member died is enqueued again on a live lane
  (same bus id; its execution claim keeps it to one run) — it is worth nothing beyond its
  ingress anyway, which holds the client's connection.
* **claim bucket i** (:func:`kairos.contracts.subjects.claims_bucket`) likewise; a claim holds when a
  majority of the buckets took it (kairos/runtime/claims.py).

Everything else (the view, reservations, records, models) stays replicated on every member:
nothing on a request's path to its first token waits for those. A single nats-server has lane 0
and claim bucket 0 only, without placement.
"""

from __future__ import annotations

import asyncio
import time
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import (AckPolicy, ConsumerConfig, DiscardPolicy, Placement, RetentionPolicy, StorageType,
                         StreamConfig)
from nats.js.kv import KeyValue

from kairos.contracts import subjects as S
from kairos.runtime.bus import stream_replicas
from kairos.runtime.streams import creating
from kairos.runtime.envconfig import ConfigError

#: a lane whose publish found no stream (its member is down) is skipped for this long (s)
LANE_DOWN_S = 1.0
#: a request queued this long (s) on a lane that delivered nothing meanwhile, while another lane
#: did, is enqueued again on a live lane (its member is gone, or its consumer cannot deliver)
LANE_STALL_S = 1.0


def lane_count(cfg) -> int:
    """Lanes of a deployment: ``KAIROS_NATS_LANES`` (``cfg.nats_lanes``) if set, else one per NATS
    member (``kairos.runtime.bus.stream_replicas``: ``KAIROS_NATS_REPLICAS``, else the number of server
    URLs), at most :data:`S.MAX_LANES`."""
    return max(1, min(getattr(cfg, "nats_lanes", 0) or stream_replicas(cfg), S.MAX_LANES))


def placement(lane: int, lanes: int) -> Placement | None:
    """Where lane ``lane``'s stream / claim bucket goes: the member tagged :func:`S.lane_tag`, or
    anywhere (None) with one lane."""
    return Placement(tags=[S.lane_tag(lane)]) if lanes > 1 else None


def lane_stream_config(lane: int, lanes: int, max_age_s: float) -> StreamConfig:
    """Request lane ``lane``'s stream: work queue, file storage, one replica, dedup window 120 s."""
    return StreamConfig(name=S.request_stream(lane), subjects=[S.request_subject(lane)], num_replicas=1,
                        retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE, discard=DiscardPolicy.OLD,
                        max_age=max_age_s, duplicate_window=120.0, placement=placement(lane, lanes),
                        description=f"Kairos client requests, lane {lane}: ingress -> dispatchers (work queue)")


def dispatcher_consumer_config(lane: int, ack_wait_s: float, max_deliver: int) -> ConsumerConfig:
    """The dispatchers' shared durable pull consumer on lane ``lane``."""
    return ConsumerConfig(durable_name=S.DISPATCHER_CONSUMER, name=S.DISPATCHER_CONSUMER,
                          ack_policy=AckPolicy.EXPLICIT, ack_wait=ack_wait_s, max_deliver=max_deliver,
                          filter_subject=S.request_subject(lane), max_ack_pending=10_000,
                          description="all dispatcher replicas pull from this one consumer")


def claims_bucket_config(lane: int, lanes: int, ttl_s: float = 3600.0) -> StreamConfig:
    """The stream ``KV_kairos_claims_<lane>`` of claim bucket ``lane``: a KV bucket's stream as
    nats-py's ``create_key_value`` builds it (nats-py 2.x ``nats/js/client.py``: ``$KV.<bucket>.>``,
    rollups, per-message TTLs, no deletes through the API, discard new, history 1), plus what that
    call drops: the placement on member ``lane`` (``KeyValueConfig.placement`` is not passed on, so
    buckets landed on any member — two on one member would take the majority with it). One
    replica, file storage, direct gets (an agent reads a claim by key only, docs/security.md),
    kept ``ttl_s`` (the records' hour)."""
    bucket = S.claims_bucket(lane)
    return StreamConfig(name=f"KV_{bucket}", subjects=[f"$KV.{bucket}.>"], num_replicas=1,
                        placement=placement(lane, lanes), storage=StorageType.FILE, max_age=ttl_s,
                        max_msgs_per_subject=1, max_msgs=-1, max_consumers=-1, allow_direct=True,
                        allow_rollup_hdrs=True, allow_msg_ttl=True, deny_delete=True, discard=DiscardPolicy.NEW,
                        duplicate_window=min(120.0, ttl_s),
                        description=f"execution claims, member {lane} of a majority (kairos/runtime/claims.py)")


def claim_buckets(js: JetStreamContext, lanes: int) -> list[KeyValue]:
    """Handles of the ``lanes`` claim buckets, without asking the server (an agent may not read a
    stream's info, and a bucket whose member is down must still be named): creates, direct gets
    and deletes only, which is all a claim needs."""
    return [KeyValue(name=S.claims_bucket(i), stream=f"KV_{S.claims_bucket(i)}",
                     pre=f"$KV.{S.claims_bucket(i)}.", js=js, direct=True) for i in range(lanes)]


async def declare_each(what: str, lanes: int, declare, log=None) -> list[int]:
    """Run ``declare(lane)`` for every lane at once; the lanes it failed for are logged
    (``<what>_declare_failed``: that member is down; its lane is declared again later) and left
    out of the returned list of declared lanes.

    Raises:
        ConfigError: a lane exists with another configuration (``kairos.runtime.streams.StreamConfigMismatch``).
        the first error when no lane could be declared (nothing would work).
    """
    res = await asyncio.gather(*(declare(i) for i in range(lanes)), return_exceptions=True)
    errors = [(i, r) for i, r in enumerate(res) if isinstance(r, BaseException)]
    for _, exc in errors:
        if isinstance(exc, ConfigError):  # a deployment that disagrees with itself: not a member down
            raise exc
    for i, exc in errors:
        if log is not None:
            log.warning(f"{what}_declare_failed", lane=i, error=repr(exc))
    if len(errors) == lanes:
        raise errors[0][1]
    return [i for i in range(lanes) if not isinstance(res[i], BaseException)]


async def ensure_lane(js: JetStreamContext, lane: int, lanes: int, max_age_s: float = 600.0,
                      consumer: tuple[float, int] | None = None) -> None:
    """Declare request lane ``lane``'s stream and, with ``consumer`` = (ack_wait_s, max_deliver),
    the dispatchers' consumer on it. Raises nats-py's JetStream errors."""
    await creating(lambda: js.add_stream(lane_stream_config(lane, lanes, max_age_s)),
                   what=f"request lane {lane} ({S.request_stream(lane)}, of {lanes})")
    if consumer is not None:
        await js.add_consumer(S.request_stream(lane), dispatcher_consumer_config(lane, *consumer))


async def ensure_claims_bucket(js: JetStreamContext, lane: int, lanes: int) -> None:
    """Declare claim bucket ``lane`` (the ingress and dispatchers do; agents may not)."""
    await creating(lambda: js.add_stream(claims_bucket_config(lane, lanes)),
                   what=f"claim bucket {lane} ({S.claims_bucket(lane)}, of {lanes})")


async def ensure_claim_buckets(js: JetStreamContext, lanes: int, log=None) -> list[int]:
    """Declare every claim bucket (:func:`declare_each`: the ones whose member is down are logged
    and left out). What a control-plane service declares besides ``kairos.runtime.streams.ensure_buckets``:
    node agents may not, and refuse jobs (``claim_failed``) until the buckets exist."""
    return await declare_each("claims_bucket", lanes, lambda i: ensure_claims_bucket(js, i, lanes), log)


async def check_lane_count(js: JetStreamContext, lanes: int) -> None:
    """Refuse to start with fewer lanes than the deployment has: a request lane beyond this
    service's count exists (another service declared it), so this one would pull or claim from too
    few (two claim majorities need not meet: a request could run twice).

    Raises:
        ConfigError: lane ``lanes`` exists. A server that does not answer proves nothing: no error.
    """
    if lanes >= S.MAX_LANES:
        return
    try:
        await js.stream_info(S.request_stream(lanes))
    except (nats.errors.Error, asyncio.TimeoutError):  # not found (as it should be), or no answer
        return
    raise ConfigError(f"the NATS deployment has request lane {lanes} ({S.request_stream(lanes)}) but this service "
                      f"is configured for {lanes} lane(s): every service needs the same KAIROS_NATS_LANES / "
                      f"KAIROS_NATS_REPLICAS / KAIROS_NATS_URL member list (docs/deploy.md), or remove the streams of "
                      f"an older, larger deployment")


async def consumer_infos(js: JetStreamContext, lanes: int, timeout_s: float) -> list:
    """The dispatchers' consumer info of every lane, asked at once: one entry per lane, the
    exception where the lane did not answer (its member is down, or it was never declared).
    Never raises (the ingress's /health and the aggregator's queue gauges sum what answered)."""
    return await asyncio.gather(*(js.consumer_info(S.request_stream(i), S.DISPATCHER_CONSUMER, timeout=timeout_s)
                                  for i in range(lanes)), return_exceptions=True)


class LanePicker:
    """The ingress's choice of lane per enqueue, and which queued requests to move (pure, no I/O).

    Lanes are taken in turn; a lane whose publish found no stream or timed out (:meth:`down`) is
    skipped for :data:`LANE_DOWN_S`. ``time.monotonic`` seconds throughout.
    """

    def __init__(self, lanes: int) -> None:
        if lanes < 1:
            raise ValueError("at least one lane")
        self.lanes = lanes
        self._next = 0
        self.down_until = [0.0] * lanes
        self.delivered_at = [0.0] * lanes  #: when a request enqueued on each lane was last routed

    def order(self, now: float | None = None) -> list[int]:
        """Lanes to try for the next enqueue: the live ones in turn, then the ones marked down
        (a lane marked down may be back; with every lane down the caller retries them all)."""
        now = time.monotonic() if now is None else now
        start, self._next = self._next, (self._next + 1) % self.lanes
        ring = [(start + k) % self.lanes for k in range(self.lanes)]
        return [i for i in ring if self.down_until[i] <= now] + [i for i in ring if self.down_until[i] > now]

    def down(self, lane: int, now: float | None = None) -> None:
        """A publish to ``lane`` found no stream or got no acknowledgement."""
        self.down_until[lane] = (time.monotonic() if now is None else now) + LANE_DOWN_S

    def delivered(self, lane: int, now: float | None = None) -> None:
        """A request enqueued on ``lane`` was routed (its routing event arrived)."""
        self.delivered_at[lane] = time.monotonic() if now is None else now

    def stalled(self, lane: int, enqueued_at: float, now: float | None = None) -> bool:
        """A request enqueued on ``lane`` at ``enqueued_at`` and not routed yet should move: it
        waited :data:`LANE_STALL_S`, and its lane was marked down since, or routed nothing since
        while another lane did (under a backlog every lane keeps routing its older requests, and
        with no dispatcher at all no lane routes: nothing moves then)."""
        now = time.monotonic() if now is None else now
        if self.lanes == 1 or now - enqueued_at < LANE_STALL_S:
            return False
        if self.down_until[lane] > enqueued_at:
            return True
        return self.delivered_at[lane] < enqueued_at and any(
            t > enqueued_at for i, t in enumerate(self.delivered_at) if i != lane)

    def others(self, lane: int, now: float | None = None) -> list[int]:
        """Lanes to move a request queued on ``lane`` to (:meth:`order` without ``lane``)."""
        return [i for i in self.order(now) if i != lane]


def lane_of(stream: str, lanes: int) -> int | None:
    """The lane whose stream is ``stream`` (a publish acknowledgement's ``stream``), None if none."""
    for i in range(lanes):
        if S.request_stream(i) == stream:
            return i
    return None


def is_missing_stream(exc: BaseException) -> bool:
    """A publish found no stream on its subject (its member is down, or it was never declared)."""
    return isinstance(exc, (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError))

