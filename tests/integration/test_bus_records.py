"""Issue 17 part 1, the holes left after tests/integration/test_bus_origin.py: what an agent may read
and write in the requests bucket and who may tell a prefill node its KV was pulled. Each attack is
made with only decode-0's agent credential against a real nats-server running the generated
permission table, the stack logged in as its roles; each ends in a violation the server reports to
the attacker or in a refusal the victim counts, and the victim's state shows nothing changed.
"""

from __future__ import annotations

import nats
import pytest
from nats.js.api import KeyValueConfig, StorageType

from kairos.contracts import subjects as S
from kairos.runtime.bus import flush_barrier
from kairos.runtime.streams import BucketLayoutError, ensure_buckets
from kairos.contracts.permissions import agent_user
from kairos.contracts.wire import InferenceRequest, Job, KvDone, encode, now_ms
from kairos.contracts.records import PrefillTiming
from tests.integration.conftest import ADMIN_USER, get_record, reset_bus, secure_server, stack, wait_until
from tests.integration.test_bus_origin import forged_count
from tests.integration.test_bus_security import _close, as_role

NODES = ["prefill-0", "decode-0", "decode-1"]
ATTACKER = agent_user("decode-0")
#: a direct get of a key of the requests bucket (an agent has no JetStream API at all since issue 34)
DIRECT_GET = f"$JS.API.DIRECT.GET.KV_{S.REQUESTS_BUCKET}.$KV.{S.REQUESTS_BUCKET}."


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    with secure_server(tmp_path_factory.mktemp("records-nats"), NODES) as server:
        yield server


async def _served_elsewhere(st) -> str:
    """A request served on the keep path by prefill-0 and decode-1 (decode-0, the attacker, drains)."""
    st.agents["decode-0"].accepting = False
    await wait_until(lambda: all(not n.accepting for n in st.ingress.view.nodes if n.node == "decode-0"), 5,
                     "decode-0 draining in the view")
    status, body = await st.complete("someone else's request", max_tokens=3)
    assert status == 200, body
    return body["id"]


async def test_a_direct_get_with_a_literal_wildcard_names_no_request(secure):
    """nats-server answers a direct get whose key holds a literal ``*`` with the newest message
    matching it (``last_by_subj`` with wildcards), and a permission pattern cannot tell that ``*``
    from a key: with claims keyed ``<rid>.claim`` an agent polling ``*.claim`` learned the ids of
    other nodes' requests. Since issue 34 an agent has no get at all: each wildcard shape it might
    try is a publish violation, and nothing it is answered names the request."""
    url, pw = secure
    async with stack(url, prefill=1, decode=2, dispatchers=1, passwords=pw, policy="pd") as st:
        rid = await _served_elsewhere(st)
        attacker = await as_role(url, pw, ATTACKER)
        answers: dict[str, object] = {}

        async def on_answer(msg) -> None:
            answers[msg.subject.rsplit(".", 1)[1]] = msg
        inbox = attacker.nc.new_inbox()
        await attacker.nc.subscribe(inbox + ".*", cb=on_answer)
        keys = ["*.claim", "claim.*", "*.*", ">", "*.decision", "*.prefill.*", "*.decode.*", "*.ingress"]
        for i, key in enumerate(keys):
            await attacker.nc.publish(DIRECT_GET + key, b"", reply=f"{inbox}.{i}")
        await flush_barrier(attacker.nc)

        def refused(i: int) -> bool:
            return any("violation" in e.lower() and f'"{(DIRECT_GET + keys[i]).lower()}"' in e.lower()
                       for e in attacker.errors)
        await wait_until(lambda: all(refused(i) for i in range(len(keys))), 5, "a violation for every get")
        for i, key in enumerate(keys):
            msg = answers.get(str(i))
            if msg is None:
                continue
            shown = msg.data.decode(errors="replace") + repr(msg.headers)
            assert rid not in shown, f"a direct get of {key!r} named request {rid}: {shown}"
        await _close(attacker)


async def test_an_agent_cannot_write_another_nodes_request_record(secure):
    """Any agent could overwrite any request's ``.prefill`` / ``.decode`` record (NATS KV records
    no author). Records are now keyed by the node that writes them and an agent may write only its
    own: prefill-0's record key is a publish violation for decode-0, and what decode-0 writes
    under its own id for that request is not what GET /v1/requests/{id} shows."""
    url, pw = secure
    async with stack(url, prefill=1, decode=2, dispatchers=1, passwords=pw, policy="pd") as st:
        rid = await _served_elsewhere(st)
        real = await _record(st, rid)
        attacker = await as_role(url, pw, ATTACKER)
        forged = PrefillTiming(node="prefill-0", received_unix_ms=1.0, prefill_start_unix_ms=2.0,
                               prefill_done_unix_ms=3.0, handoff_node="decode-0", error="forged")
        for key in (f"{rid}.prefill", f"{rid}.decode", S.record_key(rid, "prefill", "prefill-0"),
                    S.record_key(rid, "decode", "decode-1")):
            await attacker.nc.publish(f"$KV.{S.REQUESTS_BUCKET}.{key}", encode(forged))
            await attacker.violation(f"$KV.{S.REQUESTS_BUCKET}.{key}", "publish")
        # its own key for that request: stored (acknowledged), never read for this request
        own = f"$KV.{S.REQUESTS_BUCKET}.{S.record_key(rid, 'prefill', 'decode-0')}"
        await attacker.nc.jetstream().publish(own, encode(forged))
        assert await _record(st, rid) == real
        assert real["prefill"]["node"] == "prefill-0" and real["prefill"]["handoff_node"] == "decode-1"
        await _close(attacker)


async def _record(st, rid: str) -> dict:
    """The node records GET /v1/requests/{rid} shows (``prefill`` and ``decode``: what an agent
    writes), once both are written (unacknowledged puts). The ingress's own record is left out: it
    is written when the stream ends, so it may appear between two reads."""
    rec = await get_record(st, rid, lambda r: r["records"]["prefill"] is not None and r["records"]["decode"] is not None)
    return {k: rec["records"][k] for k in ("prefill", "decode")}


async def test_a_kv_pulled_notice_must_come_from_a_decode_node_the_kv_was_offered_to(secure):
    """``kairos.kvdone.<prefill>`` named no sender: any agent could make a prefill node release a
    KV cache a decode node was still to pull. The subject now names the sender's NATS user and the
    prefill node accepts the notice only from a decode node its job named. prefill-0 is made to
    hold a KV cache for decode-1 (the agent's own bookkeeping of a handed-off prefill); decode-0's
    notices are refused, decode-1's releases it."""
    url, pw = secure
    async with stack(url, prefill=1, decode=2, dispatchers=1, passwords=pw) as st:
        victim = st.agents["prefill-0"]
        rid = "held-kv-1"
        req = InferenceRequest(request_id=rid, model="m", prompt_tokens=8, max_tokens=4, created_unix_ms=now_ms(),
                               deadline_unix_ms=now_ms() + 60_000)
        from kairos.core.vocabulary import RequestPhase, RequestRole
        from kairos.services.node_agent.request import NodeRequest
        from kairos.services.node_agent.tracing import RequestSpans
        victim.reqs[rid] = NodeRequest(req=req, role=RequestRole.PREFILL, node="prefill-0", phase=RequestPhase.HANDED_OFF,
                                       received_ms=now_ms(), spans=RequestSpans(main=victim.tel.tracer.start_span("t")),
                                       job=Job(kind="keep", request=req, node="prefill-0", decode_candidates=["decode-1"]),
                                       handoff_node="decode-1", handoff_sent_ms=now_ms())
        attacker = await as_role(url, pw, ATTACKER)
        old = f"{S.PREFIX}.kvdone.prefill-0"  # the subject before it named its sender
        await attacker.nc.publish(old, encode(KvDone(request_id=rid, decode_node="decode-1", ok=True)))
        await attacker.violation(old, "publish")
        spoofed = S.kvdone_subject("prefill-0", agent_user("decode-1"))
        await attacker.nc.publish(spoofed, encode(KvDone(request_id=rid, decode_node="decode-1", ok=True)))
        await attacker.violation(spoofed, "publish")
        own = S.kvdone_subject("prefill-0", ATTACKER)
        for named in ("decode-1", "decode-0"):  # names another node / is not a node the KV went to
            await attacker.nc.publish(own, encode(KvDone(request_id=rid, decode_node=named, ok=True)))
        await flush_barrier(attacker.nc)
        await wait_until(lambda: forged_count(victim, "kv_done") == 2, 5, "both notices refused")
        assert rid in victim.reqs
        holder = await as_role(url, pw, agent_user("decode-1"))
        await holder.nc.publish(S.kvdone_subject("prefill-0", agent_user("decode-1")),
                                encode(KvDone(request_id=rid, decode_node="decode-1", ok=True)))
        await flush_barrier(holder.nc)
        await wait_until(lambda: rid not in victim.reqs, 5, "decode-1's notice releasing the KV")
        assert forged_count(victim, "kv_done") == 2
        await _close(attacker, holder)


async def test_a_requests_bucket_of_the_old_layout_is_refused_with_what_to_do(secure):
    """A store whose ``kairos_requests`` bucket predates direct gets: declaring it failed with
    nats-server's bare "stream name already in use with a different configuration"; now the
    services refuse to start with a message naming the bucket and what to do."""
    url, pw = secure
    await reset_bus(url, pw)
    nc = await nats.connect(url, user=ADMIN_USER, password=pw[ADMIN_USER])
    try:
        js = nc.jetstream()
        await js.create_key_value(KeyValueConfig(bucket=S.REQUESTS_BUCKET, history=1, storage=StorageType.FILE,
                                                 ttl=3600.0, direct=False))
        with pytest.raises(BucketLayoutError, match=rf"{S.REQUESTS_BUCKET}.*direct gets.*nats kv del"):
            await ensure_buckets(js)
    finally:
        await reset_bus(url, pw)
        await nc.close()
