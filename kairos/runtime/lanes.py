"""Claim buckets: one per NATS cluster member, so that no execution claim waits for a JetStream
leader election (issue 17, part 2).

Why: a replicated stream stops taking messages from the moment its raft leader dies until a follower
campaigns — 4–9 s later in nats-server (the election timeout of ``server/raft.go`` is compiled in).
With one 3-replica claim bucket, every member kill that took its leader stalled every new request
that long (tests/faults/test_nats_cluster.py). So, in a cluster of N members, **claim bucket i**
(:func:`kairos.contracts.subjects.claims_bucket`) has *one* replica placed on member i (server tag
:func:`kairos.contracts.subjects.lane_tag`): a single-replica stream has no raft group, and it lives
and dies with its member. A claim holds when a majority of the buckets took it
(kairos/runtime/claims.py). Requests themselves are not stored on the way to a dispatcher (issue
34: the dispatchers' queue group on core NATS, kairos/services/ingress/nats_bus.py).

Everything else (the view, reservations, records, models) stays replicated on every member:
nothing on a request's path to its first token waits for those. A single nats-server has claim
bucket 0 only, without placement.
"""

from __future__ import annotations

import asyncio

import nats.errors
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, Placement, StorageType, StreamConfig
from nats.js.kv import KeyValue

from kairos.contracts import subjects as S
from kairos.runtime.bus import stream_replicas
from kairos.runtime.envconfig import ConfigError
from kairos.runtime.streams import creating


def lane_count(cfg) -> int:
    """Claim buckets of a deployment: ``KAIROS_NATS_LANES`` (``cfg.nats_lanes``) if set, else one per NATS
    member (``kairos.runtime.bus.stream_replicas``: ``KAIROS_NATS_REPLICAS``, else the number of server
    URLs), at most :data:`S.MAX_LANES`."""
    return max(1, min(getattr(cfg, "nats_lanes", 0) or stream_replicas(cfg), S.MAX_LANES))


def placement(lane: int, lanes: int) -> Placement | None:
    """Where claim bucket ``lane`` goes: the member tagged :func:`S.lane_tag`, or anywhere (None)
    with one bucket."""
    return Placement(tags=[S.lane_tag(lane)]) if lanes > 1 else None


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
    """Refuse to start with fewer claim buckets than the deployment has: a claim bucket beyond this
    service's count exists (another service declared it), so this one would claim from too few
    (two claim majorities need not meet: a request could run twice).

    Raises:
        ConfigError: claim bucket ``lanes`` exists. A server that does not answer proves nothing: no error.
    """
    if lanes >= S.MAX_LANES:
        return
    stream = f"KV_{S.claims_bucket(lanes)}"
    try:
        await js.stream_info(stream)
    except (nats.errors.Error, asyncio.TimeoutError):  # not found (as it should be), or no answer
        return
    raise ConfigError(f"the NATS deployment has claim bucket {lanes} ({stream}) but this service "
                      f"is configured for {lanes} bucket(s): every service needs the same KAIROS_NATS_LANES / "
                      f"KAIROS_NATS_REPLICAS / KAIROS_NATS_URL member list (docs/deploy.md), or remove the streams of "
                      f"an older, larger deployment")
