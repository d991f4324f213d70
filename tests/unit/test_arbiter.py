"""The ingress's arbiter (kairos/core/cluster/arbiter.py) against random plans and answers of several
dispatchers: at no point can two nodes be running one attempt (the independent truth is a replay of
what each node could have done with the jobs it got), and nothing is sent after the attempt ended."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kairos.core.cluster.arbiter import Arbiter, ArbiterError

NODES = ["decode-0", "decode-1", "prefill-0"]


def test_a_refusal_lets_the_next_plan_go_to_another_node():
    a = Arbiter()
    assert a.plan("decode-0") == "send"
    a.answer("decode-0", "refused")
    assert a.plan("decode-1") == "send"
    a.answer("decode-1", "accepted")
    assert a.running_on == "decode-1"
    assert a.plan("decode-0") == "cancelled"


def test_no_responders_is_not_an_execution():
    a = Arbiter()
    assert a.plan("decode-0") == "send"
    a.answer("decode-0", "no_responders")
    assert a.plan("decode-0") == "send" and a.may_run == {"decode-0"}


def test_after_a_silent_node_nothing_is_sent_and_the_attempt_moves():
    a = Arbiter()
    assert a.plan("decode-0") == "send"
    a.answer("decode-0", "silent")
    assert a.plan("decode-1") == "move"
    assert a.plan("decode-0") == "cancelled" and a.ended


def test_one_job_out_at_a_time_and_an_ended_attempt_sends_nothing():
    a = Arbiter()
    assert a.plan("decode-0") == "send"
    assert a.plan("decode-1") == "cancelled"  # a second dispatcher's plan while the first job is out
    a.answer("decode-0", "refused")
    a.end()
    assert a.plan("decode-1") == "cancelled"


def test_an_answer_for_a_node_no_job_went_to_is_refused():
    a = Arbiter()
    with pytest.raises(ArbiterError):
        a.answer("decode-0", "accepted")
    a.plan("decode-0")
    with pytest.raises(ArbiterError, match="out to 'decode-1' .out to: 'decode-0'"):  # the log names both
        a.answer("decode-1", "accepted")


# a node that got a job: "run" (it took it: accepted, or silent and took it), "not" (refused, or the
# job never reached it, or silent and lost)
steps = st.lists(st.tuples(st.sampled_from(NODES),
                           st.sampled_from(["accepted", "refused", "no_responders", "silent-ran", "silent-lost"])),
                 max_size=12)


@settings(max_examples=400, deadline=None)
@given(steps)
def test_at_most_one_node_ever_runs_the_attempt(seq):
    a, ran = Arbiter(), set()
    for node, outcome in seq:
        verdict = a.plan(node)
        if verdict != "send":  # nothing went out
            assert verdict == "cancelled" or (verdict == "move" and a.ended)
            continue
        if outcome in ("accepted", "silent-ran"):  # what the node really did with the job
            ran.add(node)
        a.answer(node, "silent" if outcome.startswith("silent") else outcome)
        assert len(ran) <= 1, (seq, ran)
        assert ran <= a.may_run
    if a.ended:
        assert a.plan(NODES[0]) == "cancelled"
