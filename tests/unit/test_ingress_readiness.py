"""The ingress's view intake and ``GET /health`` (kairos/services/ingress/readiness.py).

The ingress decodes each view into :class:`ReadyView` (node id, role, staleness, accepting; the
view's stamp and ``stale_after_ms``), not the whole :class:`ClusterView` (issue 19 §3: at 288 nodes
the full decode was a fifth of its CPU). The full decode is the oracle: the same routable nodes, the
same roles, the same /health body and status, the same newer-view rule.
"""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import orjson
import pytest

from kairos.contracts.wire import ClusterView, InFlight, NodeView, decode, encode
from kairos.core.cluster.routing import routable
from kairos.core.model.correction import StepCorrection
from kairos.runtime.clock import ManualClock
from kairos.services.ingress import readiness as readiness_module
from kairos.services.ingress.config import IngressConfig
from kairos.services.ingress.liveness import FlightWatch
from kairos.services.ingress.readiness import Readiness, ReadyView

BUILT = 1_700_000_000_000.0


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def _log(self, event: str, **kw) -> None:
        self.lines.append((event, kw))

    info = warning = error = _log


def node(name: str, role: str, *, stale: bool = False, accepting: bool = True, rng: random.Random | None = None) -> NodeView:
    """A NodeView with everything the ingress skips filled in (queues, in-flight, pending ids, correction)."""
    rng = rng or random.Random(name)
    return NodeView(node=name, role=role, stale=stale, age_ms=rng.uniform(0, 400), accepting=accepting,
                    batch_size=rng.randint(0, 48), kv_tokens=rng.randint(0, 90_000),
                    queue_prompt_tokens=[rng.randint(1, 4096) for _ in range(rng.randint(0, 5))],
                    deflection_in_flight=rng.random() < 0.3,
                    in_flight=[InFlight(prompt_tokens=rng.randint(1, 4096), output_tokens=rng.randint(0, 512))],
                    waiting=rng.randint(0, 4), kv_backlog_ms=rng.uniform(0, 30), pending_routed=1,
                    state_sent_unix_ms=BUILT - rng.uniform(0, 300), pending_ids=[f"cmpl-{rng.getrandbits(64):x}"],
                    correction=StepCorrection(bias=rng.uniform(0.8, 1.3), safety=1.4, samples=99, window_ms=1e4))


def view(seq: int, nodes: list[NodeView], built: float = BUILT, stale_after_ms: float = 300.0) -> ClusterView:
    return ClusterView(seq=seq, built_unix_ms=built, period_ms=100.0, stale_after_ms=stale_after_ms, nodes=nodes)


def random_view(rng: random.Random, seq: int) -> ClusterView:
    """0-6 prefill and 0-12 decode nodes, each stale, draining, both or neither, in a shuffled order."""
    nodes = [node(f"{role}-{i}", role, stale=rng.random() < 0.3, accepting=rng.random() >= 0.3, rng=rng)
             for role, count in (("prefill", rng.randint(0, 6)), ("decode", rng.randint(0, 12))) for i in range(count)]
    rng.shuffle(nodes)
    return view(seq, nodes, built=BUILT + seq)


def names(pair) -> tuple[list[str], list[str]]:
    return [n.node for n in pair[0]], [n.node for n in pair[1]]


EDGE_VIEWS = [
    view(1, []),
    view(2, [node("prefill-0", "prefill", stale=True), node("decode-0", "decode")]),
    view(3, [node("prefill-0", "prefill"), node("decode-0", "decode", accepting=False)]),
    view(4, [node("decode-1", "decode"), node("prefill-1", "prefill", stale=True, accepting=False),
             node("prefill-0", "prefill"), node("decode-0", "decode", stale=True)]),
]


@pytest.mark.parametrize("v", EDGE_VIEWS + [random_view(random.Random(s), s) for s in range(200)])
def test_the_ready_view_routes_and_names_roles_as_the_full_view(v):
    data = encode(v)
    full, ready = decode(data, ClusterView), decode(data, ReadyView)
    assert names(routable(ready)) == names(routable(full))  # same nodes, same order
    assert [(n.node, n.role) for n in ready.nodes] == [(n.node, n.role) for n in full.nodes]
    assert (ready.seq, ready.built_unix_ms, ready.stale_after_ms) == (full.seq, full.built_unix_ms, full.stale_after_ms)


def readiness(clock: ManualClock, cfg: IngressConfig = IngressConfig(), connected: bool = True):
    """A Readiness whose dispatchers answer pings, and the views handed to ``on_view`` in a list."""
    seen: list = []

    async def ping():
        return None

    return Readiness(cfg, lambda: connected, ping, seen.append, clock, Log()), seen


def health(r: Readiness) -> tuple[int, dict]:
    resp = asyncio.run(r.health(None))
    return resp.status, orjson.loads(resp.body)


def expected_health(full: ClusterView | None, age_ms: float | None, limit_ms: float) -> tuple[int, dict]:
    """/health's status and body from the full view, as the ingress answered before ReadyView (the
    dispatcher part: one lane with a pull waiting)."""
    reasons = []
    if full is None:
        reasons.append("no_cluster_view")
    elif age_ms is not None and age_ms > limit_ms:
        reasons.append("cluster_view_stale")
    pfs, dcs = routable(full)
    if full is not None and (not pfs or not dcs):
        reasons.append("no_routable_nodes")
    return (503 if reasons else 200), {"status": reasons[0] if reasons else "ok", "codes": reasons,
                                        "routable": {"prefill": [n.node for n in pfs], "decode": [n.node for n in dcs]},
                                        "view_age_ms": age_ms}


def summary(status: int, body: dict) -> tuple[int, dict]:
    return status, {"status": body["status"], "codes": [r["code"] for r in body["reasons"]],
                    "routable": body["routable"], "view_age_ms": body["view_age_ms"]}


@pytest.mark.parametrize("v", EDGE_VIEWS + [random_view(random.Random(s), s) for s in range(30)])
def test_health_answers_as_with_the_full_view(v):
    clock = ManualClock()
    r, seen = readiness(clock)
    assert summary(*health(r)) == expected_health(None, None, 0.0)
    r.take_view(encode(v))
    assert summary(*health(r)) == expected_health(v, 0.0, v.stale_after_ms)
    clock.advance((v.stale_after_ms + 1.0) / 1000.0)  # the aggregator stopped publishing
    status, body = health(r)
    assert summary(status, body) == expected_health(v, v.stale_after_ms + 1.0, v.stale_after_ms)
    assert body["reasons"][0]["message"].startswith("the cluster view is 301 ms old (stale after 300 ms)")
    assert [(n.node, n.role) for n in seen[0].nodes] == [(n.node, n.role) for n in v.nodes]


def test_the_configured_staleness_overrides_the_views():
    clock = ManualClock()
    r, _ = readiness(clock, IngressConfig(view_stale_after_ms=1000.0))
    r.take_view(encode(EDGE_VIEWS[3]))
    clock.advance(0.5)  # past the view's 300 ms, within the configured 1000 ms
    assert health(r)[0] == 200
    clock.advance(0.6)
    assert health(r)[1]["status"] == "cluster_view_stale"


def test_only_a_newer_view_is_taken_and_the_second_copy_is_dropped():
    clock = ManualClock()
    r, seen = readiness(clock)
    v1, v2 = view(1, [node("decode-0", "decode")]), view(2, [node("decode-0", "decode"), node("prefill-0", "prefill")],
                                                          built=BUILT + 100)
    r.take_view(encode(v1))
    clock.advance(0.05)
    r.take_view(encode(v1))  # the bucket's copy: not newer, and the view's age is not reset
    assert [v.seq for v in seen] == [1] and r.view_rx == 1000.0
    r.take_view(encode(v2))
    r.take_view(encode(v1))  # a lagging bucket's older view
    r.take_view(encode(v2))
    r.take_view(b"not json")
    r.take_view(encode(v1)[:-1])
    assert [v.seq for v in seen] == [1, 2] and r.ready.seq == 2 and r.view_rx == 1000.05
    restarted = view(1, [node("decode-1", "decode")], built=BUILT + 200)  # a restarted aggregator's seq 1, built later
    r.take_view(encode(restarted))
    assert [v.seq for v in seen] == [1, 2, 1] and r.ready == decode(encode(restarted), ReadyView)


def test_a_newer_view_without_the_fields_the_ingress_reads_is_refused():
    r, seen = readiness(ManualClock())
    r.take_view(encode(view(1, [node("decode-0", "decode")])))
    body = orjson.loads(encode(view(2, [node("decode-0", "decode")], built=BUILT + 1)))
    del body["nodes"][0]["role"]
    r.take_view(orjson.dumps(body))
    assert [v.seq for v in seen] == [1]


def test_the_full_view_is_decoded_on_demand_only(monkeypatch):
    decoded: list[type] = []
    real = readiness_module.decode
    monkeypatch.setattr(readiness_module, "decode", lambda data, typ: decoded.append(typ) or real(data, typ))
    r, _ = readiness(ManualClock())
    assert r.view is None
    v1, v2 = random_view(random.Random(1), 1), random_view(random.Random(2), 2)
    for v in (v1, v1, v2, v2):
        r.take_view(encode(v))
    assert decoded == [ReadyView, ReadyView]  # per view: the few fields /health reads, nothing more
    assert r.view == v2 and r.view is r.view  # the whole view, when asked (Ingress.view), decoded once
    assert decoded == [ReadyView, ReadyView, ClusterView]
    v3 = random_view(random.Random(3), 3)
    r.take_view(encode(v3))
    assert r.view == v3  # a newer view replaces the full one decoded before


def test_the_liveness_watcher_learns_the_roles_of_the_ready_view():
    watch = SimpleNamespace(roles={"decode-9": "decode"})
    ready = decode(encode(EDGE_VIEWS[3]), ReadyView)
    FlightWatch.on_view(watch, ready)  # type: ignore[arg-type]
    assert watch.roles == {"decode-9": "decode", "decode-0": "decode", "decode-1": "decode",
                           "prefill-0": "prefill", "prefill-1": "prefill"}


def test_a_failing_on_view_is_logged_and_the_view_kept():
    def boom(_v):
        raise RuntimeError("boom")

    async def ping():
        return None

    log = Log()
    r = Readiness(IngressConfig(), lambda: True, ping, boom, ManualClock(), log)
    r.take_view(encode(EDGE_VIEWS[2]))
    assert r.ready.seq == 3 and log.lines == [("view_check_failed", {"error": "RuntimeError('boom')"})]


def test_a_dispatcher_busy_for_a_moment_still_counts_as_taking_requests():
    """A dispatcher may miss a ping's second (a loaded machine): one that answered within
    ``dispatcher_active_window_s`` keeps /health's dispatcher check ok; one never heard, or heard
    longer ago, does not (503 ``no_dispatcher``); with none subscribed at all, the detail says so."""
    clock = ManualClock()
    answer: list[str | None] = ["no_responders"]
    pings = [0]

    async def ping():
        pings[0] += 1
        return answer[0]

    cfg = IngressConfig()
    r = Readiness(cfg, lambda: True, ping, lambda _v: None, clock, Log())

    def check() -> dict:
        clock.advance(cfg.dispatcher_check_interval_s)  # past the cached answer
        return asyncio.run(r.dispatcher_check())

    out = check()  # right after start, before any dispatcher: not ready
    assert not out["consuming"] and "no dispatcher subscribes" in out["detail"] and pings[0] == 1
    answer[0] = None
    assert check()["consuming"]
    answer[0] = "timeout"  # busy: pinged twice, unanswered, but heard lately
    n = pings[0]
    out = check()
    assert out["consuming"] and out["detail"].startswith("ok: a dispatcher answered"), out
    assert pings[0] == n + 2
    clock.advance(cfg.dispatcher_active_window_s)  # not heard for longer than the window: gone
    out = check()
    assert not out["consuming"] and "answered a ping" in out["detail"]
