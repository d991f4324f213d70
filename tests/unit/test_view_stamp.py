"""kairos.services.state_aggregator.view.decode_if_newer: each reader gets every view twice (subject
and bucket); the second copy is dropped after its stamp, without decoding its nodes."""

import orjson
import pytest

from kairos.contracts.wire import ClusterView, NodeView, WireError, encode
from kairos.services.state_aggregator.view import decode_if_newer


def view(seq: int, built: float) -> ClusterView:
    return ClusterView(seq=seq, built_unix_ms=built, period_ms=100.0, stale_after_ms=300.0,
                       nodes=[NodeView(node="decode-0", role="decode", stale=False, age_ms=1.0)])


def with_broken_nodes(v: ClusterView) -> bytes:
    """``v`` on the wire with a node that is not a NodeView (no role, no stale flag)."""
    body = orjson.loads(encode(v))
    body["nodes"] = [{"node": "decode-0"}]
    return orjson.dumps(body)


def test_the_first_view_and_a_newer_one_are_decoded_in_full():
    first = decode_if_newer(encode(view(1, 1000.0)), None)
    assert first == view(1, 1000.0)
    assert decode_if_newer(encode(view(2, 1100.0)), first) == view(2, 1100.0)
    assert decode_if_newer(encode(view(1, 1100.0)), first) == view(1, 1100.0)  # a restarted aggregator's seq


@pytest.mark.parametrize("seq,built", [(1, 1000.0), (0, 1000.0), (9, 999.0)])
def test_a_copy_or_an_older_view_is_dropped_on_its_stamp_alone(seq, built):
    held = view(1, 1000.0)
    assert decode_if_newer(encode(view(seq, built)), held) is None
    # the nodes are not decoded: broken ones go unnoticed in a dropped copy...
    assert decode_if_newer(with_broken_nodes(view(seq, built)), held) is None


def test_a_newer_view_is_checked_in_full():
    # ...but not in a view that is used
    with pytest.raises(WireError, match="ClusterView"):
        decode_if_newer(with_broken_nodes(view(2, 1100.0)), view(1, 1000.0))
    with pytest.raises(WireError):
        decode_if_newer(b"not json", view(1, 1000.0))
    with pytest.raises(WireError):
        decode_if_newer(b'{"nodes": []}', None)


def test_the_dispatchers_second_copy_is_dropped_on_its_bytes(monkeypatch):
    """RoutingState.take_view: the bucket's copy of a view (the same bytes) is not even stamp-decoded;
    a newer view is taken, and a view equal to an older one's bytes after a newer was taken is not."""
    from kairos.runtime.clock import ManualClock
    from kairos.services.dispatcher import state as state_mod

    calls = []
    real = state_mod.decode_if_newer
    monkeypatch.setattr(state_mod, "decode_if_newer", lambda data, than: calls.append(data) or real(data, than))
    st = state_mod.RoutingState(clock=ManualClock(now_ms=1000.0))
    first, second = encode(view(1, 1000.0)), encode(view(2, 1100.0))
    st.take_view(first)
    st.take_view(first)  # the bucket's copy
    assert calls == [first] and st.view == view(1, 1000.0)
    st.take_view(second)
    st.take_view(first)  # an older view, other bytes than the held one's: decoded as far as its stamp, dropped
    assert calls == [first, second, first] and st.view == view(2, 1100.0)
