"""The dispatcher's incremental snapshot (issue 19 §3) against the straightforward functions.

:meth:`RoutingState.snapshot` (a :class:`~kairos.core.cluster.routing.SnapshotBuilder` per view, the
routed events and reservations handed to it as they change) must give the snapshot and decision that
:func:`~kairos.core.cluster.routing.build_snapshot` of :meth:`RoutingState.snapshot_inputs` gives — a
different implementation, kept as the oracle. Seeded random sequences of what a replica hears (views,
routed events, reservations watched, answered, held, released, expiring, the wall clock stepping back)
compare the two after every step; the named tests change one input between two requests.
"""

from __future__ import annotations

import random

import msgspec
import pytest

from kairos.contracts import subjects as S
from kairos.contracts.wire import (ClusterView, InferenceRequest, NodeView, Reservation, RoutedEvent, StepCorrection,
                                   encode)
from kairos.core.cluster.routing import SnapshotBuilder, build_snapshot, decide_within_slots, fold_recent
from kairos.core.model.latency import load_profile
from kairos.core.policy import parse_policy
from kairos.runtime.clock import ManualClock
from kairos.services.dispatcher.config import DispatcherConfig
from kairos.services.dispatcher.state import RoutingState

MODEL = load_profile()
#: kairos (1 slot, skips reserved nodes), kairos+ (4 slots, projects them, prefix-aware) and a static
#: policy that deflects every request, onto reserved nodes too (rule 3 turns those into keeps)
POLICIES = {name: (parse_policy(name), DispatcherConfig(policy=name).params(MODEL.engine.max_num_batched_tokens))
            for name in ("kairos", "kairos+", "sl:100000")}


def request(rid: str, prompt: int = 700) -> InferenceRequest:
    return InferenceRequest(request_id=rid, model="m", prompt_tokens=prompt, max_tokens=64, created_unix_ms=0.0,
                            deadline_unix_ms=1e15)


def same(state: RoutingState, req: InferenceRequest, excluded: dict, full: set, hits: dict, slots: int,
         policies=POLICIES) -> None:
    """The incremental snapshot and each policy's decision on it equal the oracle's."""
    now = state.clock.now_ms()
    view, held = state.snapshot_inputs(now)
    want = build_snapshot(req, view, held, excluded, now, slots, full, hits)
    got, counts = state.snapshot(req, excluded, full, hits, slots, now)
    assert got == want
    if want is None:
        return
    assert msgspec.json.encode(got) == msgspec.json.encode(want)  # same floats to the bit, same order
    for policy, params in policies.values():
        assert decide_within_slots(policy, got, MODEL, params, counts, full, slots) == \
            decide_within_slots(policy, want, MODEL, params, held, full, slots)


class World:
    """A random replica's inputs (seeded): small clusters, so that events, reservations, exclusions
    and prefix hits often land on the same nodes and created times often tie."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.clock = ManualClock(now_ms=1_000_000.0)
        self.state = RoutingState(clock=self.clock)
        self.seq, self.rev = 0, 0
        self.rids = [f"r{i}" for i in range(12)]
        self.n_p, self.n_d = self.rng.randint(1, 4), self.rng.randint(1, 6)

    def names(self) -> list[str]:
        return [f"prefill-{i}" for i in range(self.n_p)] + [f"decode-{i}" for i in range(self.n_d)] + ["gone-0"]

    def node(self, name: str) -> NodeView:
        r, now = self.rng, self.clock.now_ms()
        return NodeView(node=name, role="prefill" if name.startswith("prefill") else "decode",
                        stale=r.random() < 0.1, accepting=r.random() > 0.1,
                        age_ms=r.choice([0.0, 5.0, 40.0, r.random() * 99]),
                        batch_size=r.randint(0, 40), kv_tokens=r.randint(0, 60_000), waiting=r.randint(0, 2),
                        queue_prompt_tokens=[r.randint(0, 4000) for _ in range(r.randint(0, 3))],
                        kv_backlog_ms=r.random() * 10, state_sent_unix_ms=now - r.choice([0.0, 30.0, 80.0]),
                        pending_ids=r.sample(self.rids, r.randint(0, 2)),
                        correction=StepCorrection(bias=r.choice([1.0, 1.2]), safety=r.choice([1.0, 1.5])))

    def view(self) -> None:
        self.seq += 1
        names = self.names()[:-1]
        if self.rng.random() < 0.1:
            names.append(self.rng.choice(names))  # a node listed twice: the builder falls back
        self.state.take_view(encode(ClusterView(seq=self.seq, built_unix_ms=self.clock.now_ms(), period_ms=100.0,
                                                stale_after_ms=300.0, nodes=[self.node(n) for n in names])))

    def event(self) -> RoutedEvent:
        r, now = self.rng, self.clock.now_ms()
        return RoutedEvent(request_id=r.choice(self.rids), kind=r.choice(["keep", "keep", "deflect"]),
                           node=r.choice(self.names()), decode_node=r.choice([*self.names(), ""]),
                           prompt_tokens=r.randint(1, 3000), output_tokens=5,
                           node_accepted_unix_ms=r.choice([now - 100.0, now - 20.0, now, float("inf")]))

    def reservation(self) -> Reservation:
        r, now = self.rng, self.clock.now_ms()
        return Reservation(request_id=r.choice(self.rids), decode_node=r.choice(self.names()), dispatcher_id="d",
                           prompt_tokens=r.randint(1, 3000), output_tokens=r.randint(0, 50),
                           created_unix_ms=now - r.choice([0.0, 0.0, 10.0]),
                           expires_unix_ms=now + r.choice([1.0, 50.0, 500.0, 1e6]))

    def step(self) -> None:
        """One thing a replica hears (or its clocks moving)."""
        r, st = self.rng, self.state
        self.rev += 1
        key = S.reservation_key(r.choice(self.names()), r.randint(0, 1))
        op = r.randrange(12)
        if op == 0:
            self.view()
        elif op in (1, 2):
            st.remember_routed(self.event())
        elif op == 3:
            st.forget_routed(r.choice(self.rids))
        elif op == 4:
            st.apply_reservation(key, self.reservation(), self.rev - r.choice([0, 0, self.rev]))
        elif op == 5:
            value = r.choice([encode(self.reservation()), None, b"not a reservation"])
            st.watched_reservation(key, r.choice([self.rev, None, 1]), value, deleted=value is None)
        elif op == 6:
            st.hold_deflection(request(r.choice(self.rids)), r.choice(self.names()), "me", self.clock.now_ms())
        elif op == 7:
            st.release_deflection(r.choice(self.rids))
        elif op == 8 and r.random() < 0.2:
            st.forget_reservations()
        elif op == 9:
            self.clock.advance(r.choice([0.0, 0.001, 0.02, 0.2, 6.0]))  # 6 s: routed events age out
        elif op == 10 and r.random() < 0.3:
            self.clock._wall_ms -= r.choice([1.0, 60.0])  # the wall clock steps back (NTP)

    def ask(self) -> tuple:
        """A request and its routing's exclusions, full nodes and prefix hits (often none)."""
        r, names = self.rng, self.names()
        excluded = {n: "draining" for n in r.sample(names, r.choice([0, 0, 0, 1, 2]))}
        full = set(r.sample(names, r.choice([0, 0, 1])))
        hits = {n: r.choice([0, 16, 320, 5000]) for n in r.sample(names, r.choice([0, 0, 1, 3]))}
        return request(r.choice(self.rids), r.choice([1, 300, 2500, 9000])), excluded, full, hits


@pytest.mark.parametrize("seed", range(40))
def test_incremental_snapshots_and_decisions_equal_the_straightforward_ones(seed):
    w = World(seed)
    slots = w.rng.choice([1, 1, 2, 4])
    w.view()
    for _ in range(120):
        w.step()
        if w.rng.random() < 0.5:
            same(w.state, *w.ask(), slots)


def test_every_kind_of_step_was_exercised_with_something_routable():
    """The random sequences above build snapshots on many nodes, deflect, keep, and reach the
    fallback (a duplicated node) — so their equality says something."""
    seen = {"snap": 0, "deflect": 0, "in_flight": 0, "queued": 0, "fallback": 0}
    for seed in range(40):
        w = World(seed)
        w.view()
        for _ in range(120):
            w.step()
            req, excluded, full, hits = w.ask()
            snap, held = w.state.snapshot(req, excluded, full, hits, 4, w.clock.now_ms())
            seen["fallback"] += not w.state._builder._exact and w.state.view is not None
            if snap is None:
                continue
            seen["snap"] += 1
            seen["in_flight"] += any(d.in_flight for d in snap.decode_nodes)
            seen["queued"] += any(p.queue_prompt_tokens != w.state._builder._pf[i].queue_prompt_tokens
                                  for i, p in enumerate(snap.prefill_nodes)) if not excluded else 0
            policy, params = POLICIES["kairos+"]
            seen["deflect"] += decide_within_slots(policy, snap, MODEL, params, held, full, 4).deflected
    assert all(v >= 20 for v in seen.values()), seen


# -- one input changing between two requests -------------------------------------------------------

def node(name: str, **kw) -> NodeView:
    fields = dict(node=name, role="prefill" if name.startswith("prefill") else "decode", stale=False, age_ms=5.0,
                  state_sent_unix_ms=999_000.0)
    return NodeView(**{**fields, **kw})


def two_by_two(clock: ManualClock, seq: int = 1, **decode0) -> bytes:
    return encode(ClusterView(seq=seq, built_unix_ms=clock.now_ms(), period_ms=100.0, stale_after_ms=300.0,
                              nodes=[node("prefill-0"), node("prefill-1", queue_prompt_tokens=[100]),
                                     node("decode-0", **decode0), node("decode-1")]))


@pytest.fixture
def st() -> RoutingState:
    state = RoutingState(clock=ManualClock(now_ms=1_000_000.0))
    state.take_view(two_by_two(state.clock, batch_size=3))
    return state


def snap(state: RoutingState, rid: str = "r", excluded=None, full=None, slots: int = 1):
    got, _ = state.snapshot(request(rid), excluded or {}, full or set(), {}, slots, state.clock.now_ms())
    same(state, request(rid), excluded or {}, full or set(), {}, slots, policies={})
    return got


def decode0(s):
    return next(d for d in s.decode_nodes if d.id == "decode-0")


def test_a_new_view_between_two_requests_is_the_next_snapshots_view(st):
    assert decode0(snap(st)).batch_size == 3
    st.take_view(two_by_two(st.clock, seq=2, batch_size=9))
    assert decode0(snap(st)).batch_size == 9
    st.take_view(two_by_two(st.clock, seq=3, stale=True))
    assert [d.id for d in snap(st).decode_nodes] == ["decode-1"]
    st.view = msgspec.structs.replace(st.view, nodes=[n for n in st.view.nodes if n.node != "prefill-0"])
    assert [p.id for p in snap(st).prefill_nodes] == ["prefill-1"]  # a view assigned by hand counts too


def test_a_reservation_taken_released_or_expired_between_two_requests_shows(st):
    assert not decode0(snap(st)).deflection_in_flight
    key = S.reservation_key("decode-0", 0)
    r = Reservation(request_id="other", decode_node="decode-0", dispatcher_id="d", prompt_tokens=500,
                    created_unix_ms=st.clock.now_ms(), expires_unix_ms=st.clock.now_ms() + 1000.0)
    st.watched_reservation(key, 1, encode(r), deleted=False)
    assert decode0(snap(st)).deflection_in_flight
    assert not decode0(snap(st, "other")).deflection_in_flight  # its own reservation does not count
    assert decode0(snap(st, slots=2)).in_flight[0].prompt_tokens == 500  # a spare slot: projected
    st.watched_reservation(key, 2, None, deleted=True)
    assert not decode0(snap(st)).deflection_in_flight
    st.hold_deflection(request("mine"), "decode-0", "me", st.clock.now_ms())
    assert decode0(snap(st)).deflection_in_flight
    st.clock.advance(5.0)  # PENDING_DEFLECTION_MS: the held slot expires without any change
    assert not decode0(snap(st)).deflection_in_flight


def test_an_expired_reservation_counts_again_when_the_wall_clock_steps_back(st):
    """live_reservations compares expiries with the wall clock, which NTP may step back."""
    r = Reservation(request_id="other", decode_node="decode-0", dispatcher_id="d", prompt_tokens=500,
                    created_unix_ms=st.clock.now_ms(), expires_unix_ms=st.clock.now_ms() + 1000.0)
    st.apply_reservation(S.reservation_key("decode-0", 0), r, 1)
    assert decode0(snap(st)).deflection_in_flight
    st.clock.advance(1.0)
    assert not decode0(snap(st)).deflection_in_flight
    st.clock._wall_ms -= 500.0
    assert decode0(snap(st)).deflection_in_flight


def test_a_routed_event_heard_or_forgotten_between_two_requests_shows(st):
    base = snap(st)
    ev = RoutedEvent(request_id="k", kind="keep", node="prefill-1", decode_node="decode-0", prompt_tokens=40,
                     output_tokens=5, node_accepted_unix_ms=float("inf"))
    st.remember_routed(ev)
    s = snap(st)
    assert s.prefill_nodes[1].queue_prompt_tokens == [100, 40]
    assert decode0(s).kv_tokens == decode0(base).kv_tokens + 40 and decode0(s).batch_size == 4
    st.remember_routed(msgspec.structs.replace(ev, node="prefill-0"))  # its job went elsewhere after all
    s = snap(st)
    assert [p.queue_prompt_tokens for p in s.prefill_nodes] == [[40], [100]]
    st.forget_routed("k")
    assert snap(st) == msgspec.structs.replace(base, request=snap(st).request)
    st.remember_routed(ev)
    st.clock.advance(6.0)  # RECENT_ROUTED_S: it ages out
    assert snap(st).prefill_nodes[1].queue_prompt_tokens == [100]


def test_an_exclusion_or_a_full_node_added_between_two_tries_shows(st):
    excluded: dict[str, str] = {}
    assert len(snap(st, excluded=excluded).prefill_nodes) == 2
    excluded["prefill-0"] = "draining"  # RouteAttempt.refused mutates the same dict between tries
    assert [p.id for p in snap(st, excluded=excluded).prefill_nodes] == ["prefill-1"]
    excluded["prefill-1"] = "draining"
    assert snap(st, excluded=excluded) is None
    assert decode0(snap(st, full={"decode-0"})).deflection_in_flight


def test_the_builder_alone_equals_fold_recent_then_build_snapshot():
    """Without a RoutingState: events added, replaced and removed in any order."""
    clock = ManualClock(now_ms=1_000_000.0)
    view = msgspec.json.decode(two_by_two(clock, batch_size=2), type=ClusterView)
    b = SnapshotBuilder(view, 1)
    evs = [RoutedEvent(request_id=f"e{i}", kind="keep", node=f"prefill-{i % 2}", decode_node=f"decode-{i % 3}",
                       prompt_tokens=10 * (i + 1), output_tokens=1, node_accepted_unix_ms=999_500.0) for i in range(6)]
    for ev in evs:
        b.add_event(ev)
    b.add_event(evs[0])  # moves last, as RoutingState.remember_routed does
    b.remove_event("e3")
    order = [*evs[1:3], *evs[4:], evs[0]]
    assert b.build(request("r"), {}, {}, 1e6) == build_snapshot(request("r"), fold_recent(view, order), {}, {}, 1e6)
