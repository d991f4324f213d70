"""Request lanes (kairos/runtime/lanes.py): which lane the ingress tries next, when a queued request moves
to another lane, and the stream / bucket configs that put lane i on NATS member i."""

from __future__ import annotations

import pytest

from kairos.contracts import subjects as S
from kairos.runtime.envconfig import ServiceConfig
from kairos.runtime.lanes import (LANE_DOWN_S, LANE_STALL_S, LanePicker, claims_bucket_config, lane_count, lane_of,
                          lane_stream_config)

T = 1000.0  #: a monotonic clock, s


def test_lanes_are_taken_in_turn():
    p = LanePicker(3)
    assert [p.order(T)[0] for _ in range(4)] == [0, 1, 2, 0]
    assert p.order(T) == [1, 2, 0]  # a full ring: every lane is a fallback


def test_a_lane_marked_down_goes_last_until_its_time_is_up():
    p = LanePicker(3)
    p.down(0, T)
    assert p.order(T) == [1, 2, 0]
    assert p.order(T + LANE_DOWN_S - 0.01) == [1, 2, 0]  # its turn came, still down: last
    assert p.order(T + LANE_DOWN_S) == [2, 0, 1]  # back in the ring
    assert p.others(1, T + LANE_DOWN_S) == [0, 2]


def test_one_lane_never_stalls():
    p = LanePicker(1)
    p.down(0, T)
    assert not p.stalled(0, T - 10, T + 10)


def test_a_queued_request_moves_when_its_lane_went_down_after_it_was_enqueued():
    p = LanePicker(3)
    p.down(1, T + 0.2)
    assert not p.stalled(1, T, T + LANE_STALL_S - 0.01)  # not waited long enough
    assert p.stalled(1, T, T + LANE_STALL_S)
    assert not p.stalled(0, T, T + LANE_STALL_S)  # another lane's request: its lane is fine (nothing routed anywhere)


def test_a_lane_that_routes_nothing_while_another_does_is_stalled():
    p = LanePicker(3)
    p.delivered(2, T + 0.5)  # lane 2 routes; lane 0 routed nothing since the request was enqueued at T
    assert p.stalled(0, T, T + LANE_STALL_S)
    p.delivered(0, T + 0.6)
    assert not p.stalled(0, T, T + LANE_STALL_S)


def test_without_routing_anywhere_nothing_moves():
    # nothing is routed anywhere since the request was enqueued (no dispatcher): nothing to gain
    p = LanePicker(3)
    p.delivered(0, T - 5)
    p.delivered(1, T - 5)
    assert not p.stalled(0, T, T + 3 * LANE_STALL_S)


def test_under_a_backlog_a_lane_that_keeps_routing_its_older_requests_does_not_stall():
    p = LanePicker(2)
    p.delivered(1, T + 0.1)
    p.delivered(0, T + 0.4)  # an older request of lane 0, routed after ours was enqueued
    assert not p.stalled(0, T, T + 5 * LANE_STALL_S)


def test_a_stall_is_seen_however_long_ago_the_other_lane_routed_after_the_enqueue():
    # low load: lane 1 routed once, just after our request was enqueued, then nothing anywhere
    p = LanePicker(2)
    p.delivered(1, T + 0.01)
    assert p.stalled(0, T, T + 10 * LANE_STALL_S)


def test_lane_names_and_placement():
    assert [S.request_stream(i) for i in range(3)] == ["KAIROS_REQ", "KAIROS_REQ_1", "KAIROS_REQ_2"]
    assert [S.request_subject(i) for i in range(2)] == ["kairos.req.new", "kairos.req.new.1"]
    assert lane_of("KAIROS_REQ_2", 3) == 2 and lane_of("KV_kairos_view", 3) is None
    one = lane_stream_config(0, 1, 600.0)
    assert one.placement is None and one.num_replicas == 1 and one.subjects == ["kairos.req.new"]
    three = lane_stream_config(2, 3, 600.0)
    assert three.placement.tags == ["kairos-lane:2"] and three.num_replicas == 1
    claims = claims_bucket_config(1, 3)
    assert (claims.name, claims.subjects, claims.placement.tags, claims.num_replicas, claims.max_msgs_per_subject,
            claims.allow_direct) == ("KV_kairos_claims_1", ["$KV.kairos_claims_1.>"], ["kairos-lane:1"], 1, 1, True)
    with pytest.raises(S.SubjectError):
        S.request_stream(S.MAX_LANES)


@pytest.mark.parametrize("urls, replicas, lanes", [
    ("nats://a:4222", 0, 1), ("nats://a:4222,nats://b:4222,nats://c:4222", 0, 3), ("nats://a:4222", 3, 3),
    (",".join(f"nats://h{i}:4222" for i in range(7)), 0, 5),
])
def test_one_lane_per_member(urls, replicas, lanes):
    assert lane_count(ServiceConfig(nats_url=urls, nats_replicas=replicas)) == lanes
