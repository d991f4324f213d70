"""The dispatcher's 503 no_available_node message names what is missing (kairos/services/dispatcher/route.py
``no_live_nodes``): with only the decode nodes down it used to say "no live prefill and decode node"."""

from kairos.contracts.wire import ClusterView, NodeView
from kairos.services.dispatcher.route import no_live_nodes


def _view(*nodes: tuple[str, str, bool, bool]) -> ClusterView:
    return ClusterView(seq=1, built_unix_ms=0.0, period_ms=100.0, stale_after_ms=300.0,
                       nodes=[NodeView(node=n, role=r, stale=stale, age_ms=0.0, accepting=acc)
                              for n, r, stale, acc in nodes])


def test_the_message_names_the_roles_without_a_live_node():
    assert no_live_nodes(_view(("prefill-0", "prefill", False, True), ("decode-0", "decode", True, True))) \
        == "no live decode node"
    assert no_live_nodes(_view(("prefill-0", "prefill", False, False), ("decode-0", "decode", False, True))) \
        == "no live prefill node"  # draining (not accepting) is not live
    assert no_live_nodes(_view()) == "no live prefill and decode node"
    assert no_live_nodes(_view(("prefill-0", "prefill", False, True), ("decode-0", "decode", False, True))) \
        == "no routable node"
    assert "no cluster view yet" in no_live_nodes(None)
