"""The ingress's heartbeat head (issue 34) against the full heartbeat: what it reads equals the full
decode of the same bytes, and what the full decode refuses in those fields it refuses too."""

from __future__ import annotations

import msgspec
import pytest

from kairos.contracts.wire import NodeState, NodeStateHead, WireError, decode, encode

HEAD_FIELDS = ("v", "node", "role", "seq", "sent_unix_ms", "epoch_unix_ms", "period_ms")


def heartbeat(**kw) -> NodeState:
    base = dict(node="decode-3", role="decode", seq=41, sent_unix_ms=1.7e12, epoch_unix_ms=1.6e12, period_ms=100.0,
                batch_size=7, kv_tokens=9000, queue_prompt_tokens=[5, 6], cache_block_tokens=16,
                cache_stored=list(range(32768)), cache_full=True)
    return NodeState(**{**base, **kw})


def test_the_head_reads_what_the_full_heartbeat_says():
    st = heartbeat()
    head = decode(encode(st), NodeStateHead)
    assert {f: getattr(head, f) for f in HEAD_FIELDS} == {f: getattr(st, f) for f in HEAD_FIELDS}


def test_the_head_has_the_full_heartbeats_names_and_types():
    full = {f.name: f.type for f in msgspec.structs.fields(NodeState)}
    assert {f.name: f.type for f in msgspec.structs.fields(NodeStateHead)} == {f: full[f] for f in HEAD_FIELDS}


@pytest.mark.parametrize("field,value", [("role", "router"), ("seq", -1), ("node", 5), ("period_ms", "x")])
def test_what_the_full_decode_refuses_in_the_head_the_head_refuses(field, value):
    body = msgspec.json.decode(encode(heartbeat()))
    body[field] = value
    data = msgspec.json.encode(body)
    with pytest.raises(WireError):
        decode(data, NodeState)
    with pytest.raises(WireError):
        decode(data, NodeStateHead)
