"""One name per path end to end (kairos.core.vocabulary): the policy's Decision, the wire messages and
the lifecycle all say ``keep``/``deflect``; wire schema v1's ``prefill`` is still read as ``keep``."""

import msgspec
import pytest

from kairos.contracts import records as R
from kairos.contracts import wire as W
from kairos.core.policy.base import Decision, DecisionKind
from kairos.core.vocabulary import DEFLECT, KEEP, PATHS, PathKind, path_kind

V1_ROUTED = (b'{"v":1,"request_id":"r","kind":"prefill","node":"prefill-0","decode_node":"decode-0",'
             b'"prompt_tokens":1,"output_tokens":1,"node_accepted_unix_ms":1.0}')


def test_a_v1_keep_path_named_prefill_decodes_as_keep_and_is_written_back_as_keep():
    ev = W.decode(V1_ROUTED, W.RoutedEvent)
    assert ev.kind == KEEP
    assert b'"kind":"keep"' in W.encode(ev)


@pytest.mark.parametrize("cls,fields", [
    (W.RoutedEvent, dict(request_id="r", node="n", decode_node="d", prompt_tokens=1, output_tokens=1,
                         node_accepted_unix_ms=1.0)),
    (R.DecodeTiming, dict(node="n", received_unix_ms=1.0)),
])
def test_every_path_field_reads_both_paths_and_refuses_others_naming_the_field(cls, fields):
    for kind in PATHS:
        assert W.decode(W.encode(cls(kind=kind, **fields)), cls).kind == kind
    body = msgspec.json.encode({**fields, "kind": "decode"})
    with pytest.raises(W.WireError, match=r"\$\.kind"):
        W.decode(body, cls)


def test_the_decision_and_the_wire_share_the_path_names():
    assert DecisionKind is PathKind and W.PathKind is PathKind
    d = Decision(request_id="r", policy="pd", decision=KEEP, node="prefill-0", decode_node="decode-0", reason="r")
    assert msgspec.json.decode(msgspec.json.encode(d), type=Decision).decision == KEEP
    assert path_kind("prefill") == KEEP and path_kind(DEFLECT) == DEFLECT
    with pytest.raises(ValueError, match="unknown path kind 'remote_decode'"):
        path_kind("remote_decode")


def test_one_phase_and_role_vocabulary_for_the_engine_model_the_backends_and_the_agent():
    from kairos.core.engine_model import Engine, EngineConfig
    from kairos.core.engine_model import request as engine_request
    from kairos.core.vocabulary import RequestPhase, RequestRole, job_role
    from tests.factories import tiny_model

    # the engine model's constants are the vocabulary's members, not numbers of their own
    assert {engine_request.WAITING, engine_request.PREFILLING, engine_request.DEFLECTING, engine_request.AWAIT_KV,
            engine_request.READY, engine_request.DECODING, engine_request.HELD,
            engine_request.GONE} == set(RequestPhase) - {RequestPhase.HANDED_OFF}
    assert (engine_request.PREFILL, engine_request.REMOTE, engine_request.DEFLECT) == tuple(RequestRole)
    model = tiny_model()
    e = Engine(EngineConfig.from_limits("prefill", model.engine), model)
    e.add_prefill("a", 8)
    assert e.phase("a") is RequestPhase.WAITING and e.phase("a") == "waiting"  # a name on the wire and in logs
    assert [(r.path, r.node_role) for r in RequestRole] == [(KEEP, "prefill"), (KEEP, "decode"), (DEFLECT, "decode")]
    assert (job_role(KEEP), job_role(DEFLECT)) == (RequestRole.PREFILL, RequestRole.DEFLECT)
