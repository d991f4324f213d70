"""The vLLM backend's pure parts: request bodies, stream parsing, chunk conversion, step records →
StepOutput, heartbeat state from a snapshot, the agent config, and ``kairos up --engine vllm``'s plan.
(The same code against real servers: tests/vllm/servers.)"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import msgspec
import pytest

from kairos.engines.vllm.plugin.protocol import DeflectedChunk, EngineSnapshot, PrefillChunk, StepRecord, WaitingRequest
from kairos.services.node_agent.config import AgentConfig
from kairos.engines.vllm.backend import VllmBackend, step_output
from kairos.runtime.envconfig import ConfigError
from kairos.core.model.latency import load_profile
from kairos.engines.vllm.api import (EngineApiError, cached_tokens, decode_body, engine_prefill_chunks, kv_block_count,
                             parse_sse_line, prefill_body, prefill_result)
from kairos.contracts.wire import InferenceRequest, Job, KvHandoff, SamplingParams, decode, encode

ROOT = Path(__file__).resolve().parents[2]

MODEL = load_profile("cpu-tiny-vllm")


def req(rid="r1", prompt=10, out=4, text=None, ids=None) -> InferenceRequest:
    return InferenceRequest(request_id=rid, model="m", prompt_tokens=prompt, max_tokens=out, prompt_text=text,
                            prompt_token_ids=ids, created_unix_ms=0.0, deadline_unix_ms=1e15)


def test_engine_chunks_subtract_the_decision_batch():
    assert engine_prefill_chunks([66, 130, 258], 2) == [64, 128, 256]
    assert engine_prefill_chunks([512, 512], 0) == [512, 512]
    assert engine_prefill_chunks([8, 100], 10) == [1, 90]  # χ ≤ B still makes progress: 1 token
    assert engine_prefill_chunks([], 5) == []
    with pytest.raises(ValueError):
        engine_prefill_chunks([0], 0)
    with pytest.raises(ValueError):
        engine_prefill_chunks([10], -1)


def test_request_bodies_follow_the_nixl_protocol():
    r = req(ids=[5, 6, 7], prompt=3, out=9)
    p = prefill_body(r, "tiny")
    assert p["max_tokens"] == 1 and p["stream"] is False
    assert p["kv_transfer_params"] == {"do_remote_decode": True}
    assert p["vllm_xargs"] == {"kairos_rid": "r1"} and p["prompt"] == [5, 6, 7]
    params = {"do_remote_prefill": True, "remote_block_ids": [[1]], "remote_engine_id": "e"}
    d = decode_body(r, "tiny", kv_transfer_params=params)
    assert d["kv_transfer_params"] == params and d["max_tokens"] == 9 and d["stream"] is True
    assert d["stream_options"] == {"include_usage": True} and d["return_token_ids"] is True
    assert "kairos_prefill_chunks" not in d["vllm_xargs"]
    sp = SamplingParams(temperature=0.0, seed=7, stop=["w9"], ignore_eos=True)
    g = decode_body(msgspec.structs.replace(r, sampling=sp), "tiny")
    assert (g["temperature"], g["seed"], g["stop"], g["ignore_eos"]) == (0.0, 7, ["w9"], True)
    assert "top_p" not in g and "temperature" not in d  # unset: the engine's default
    assert "temperature" not in prefill_body(msgspec.structs.replace(r, sampling=sp), "tiny")
    f = decode_body(req(text="hello"), "tiny", prefill_chunks=[64, 128])
    assert f["vllm_xargs"] == {"kairos_rid": "r1", "kairos_prefill_chunks": [64, 128]}
    assert "kv_transfer_params" not in f and f["prompt"] == "hello"
    with pytest.raises(EngineApiError, match="neither prompt text nor token ids"):
        prefill_body(req(), "tiny")


def test_stream_lines_parse_tokens_finish_usage_and_errors():
    assert parse_sse_line("") is None and parse_sse_line("data: [DONE]") is None and parse_sse_line(": ping") is None
    d = parse_sse_line('data: {"choices": [{"text": " a b", "token_ids": [4, 5], "finish_reason": null}]}')
    assert (d.text, d.token_count, d.finish_reason) == (" a b", 2, None)
    d = parse_sse_line('data: {"choices": [{"text": "", "token_ids": [], "finish_reason": "stop"}]}')
    assert (d.token_count, d.finish_reason) == (0, "stop")
    u = parse_sse_line('data: {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3, '
                       '"prompt_tokens_details": {"cached_tokens": 128}}}')
    assert u.usage["completion_tokens"] == 3 and cached_tokens(u.usage) == 128
    assert cached_tokens({"prompt_tokens_details": None}) == 0
    with pytest.raises(EngineApiError, match="boom"):
        parse_sse_line('data: {"error": {"message": "boom", "code": 400}}')
    with pytest.raises(EngineApiError):
        parse_sse_line("data: {not json")


def test_prefill_result_needs_kv_transfer_params():
    params, n = prefill_result({"kv_transfer_params": {"remote_engine_id": "e", "remote_block_ids": [[1, 2]]},
                                "usage": {"prompt_tokens": 7}})
    assert params == {"remote_engine_id": "e", "remote_block_ids": [[1, 2]]} and n == 7
    assert kv_block_count(params) == 2 and kv_block_count({"remote_block_ids": [4, 5, 6]}) == 3
    with pytest.raises(EngineApiError, match="no KV blocks"):
        prefill_result({"kv_transfer_params": {"remote_engine_id": "e", "remote_block_ids": [[]]}})
    with pytest.raises(EngineApiError, match="kv-transfer-config"):
        prefill_result({"choices": [], "usage": {}})


def test_wire_carries_the_batch_at_decision_and_the_kv_transfer_params():
    j = Job(kind="deflect", request=req(ids=[1]), node="decode-0", chunk_schedule=[66], decision_batch_size=2)
    assert decode(encode(j), Job).decision_batch_size == 2
    h = KvHandoff(request=req(ids=[1]), src_node="prefill-0", kv_tokens=1, prefill_done_unix_ms=0.0,
                  kv_transfer_params={"remote_block_ids": [[1, 2]], "remote_port": 5600})
    assert decode(encode(h), KvHandoff).kv_transfer_params == {"remote_block_ids": [[1, 2]], "remote_port": 5600}
    assert decode(encode(KvHandoff(request=req(ids=[1]), src_node="p", kv_tokens=1, prefill_done_unix_ms=0.0)),
                  KvHandoff).kv_transfer_params is None


def snapshot(**kw) -> EngineSnapshot:
    base = dict(seq=1, sent_unix_ms=0.0, engine_pid=1, step=5, batch_size=2, kv_tokens=900, waiting=[],
                num_running=3, num_waiting=0, kv_cache_usage=0.25, free_kv_tokens=3000, block_size=128)
    return EngineSnapshot(**{**base, **kw})


async def test_state_and_step_output_from_the_plugins_snapshot():
    b = VllmBackend("decode", MODEL, "http://127.0.0.1:1", "ipc:///tmp/none")
    b.add_deflected(req("d1", prompt=600, ids=list(range(3, 603))), [66, 130, 258], decision_batch_size=2)
    assert b._reqs["d1"].engine_chunks == [64, 128, 256]
    snap = snapshot(waiting=[WaitingRequest("d1", 600, 408), WaitingRequest("other", 50, 50)])
    b._on_snapshot(snap)
    st = b.state()
    assert (st.batch_size, st.kv_tokens, st.free_kv_tokens, st.running, st.steps) == (2, 900, 3000, 3, 5)
    assert st.queue_prompt_tokens == [408]  # decode node: deflected prompts only
    assert st.deflection_in_flight and [(f.prompt_tokens, f.output_tokens) for f in st.in_flight] == [(408, 4)]
    assert st.used_kv_tokens == 1000  # 25 % used, 3000 free
    rec = StepRecord(step=6, started_unix_ms=1.0, wall_ms=30.0, prefill_tokens=128, decode_count=2, kv_tokens=900,
                     cached_tokens=0, chunks=[DeflectedChunk("d1", 1, 128, computed_tokens=64)])
    out = step_output(rec, b._reqs, [], MODEL)
    assert out.deflected_chunk == ("d1", 1, 130, 128)  # χ of the dispatcher's schedule, tokens the engine ran
    # the chunk's computed prefix (c = 64, the first chunk) reaches the step record and the prediction
    assert out.prefill_chunks == (("d1", 128, 64),) and (out.batch_size, out.kv_tokens) == (2, 900)
    assert out.predicted_ms == pytest.approx(MODEL.step_ms(2, 900, 128, 64))
    assert MODEL.step_ms(2, 900, 128, 64) != MODEL.step_ms(2, 900, 128, 0)
    past = step_output(StepRecord(step=7, started_unix_ms=1.0, wall_ms=1.0, prefill_tokens=30, decode_count=2,
                                  kv_tokens=900, cached_tokens=0, chunks=[DeflectedChunk("d1", 5, 30)]),
                       b._reqs, [], MODEL)
    assert past.deflected_chunk == ("d1", 5, 258, 30)  # past the end the last χ repeats
    assert b.abort("d1") is True and b.phase("d1") is None
    await asyncio_drain()


async def test_prefill_node_state_lists_every_waiting_prompt_and_marks_started_prefills():
    b = VllmBackend("prefill", MODEL, "http://127.0.0.1:1", "ipc:///tmp/none")
    b.add_prefill(req("p1", prompt=2000, ids=[3] * 2000))
    rec = StepRecord(step=6, started_unix_ms=1.0, wall_ms=30.0, prefill_tokens=1024, decode_count=0, kv_tokens=0,
                     cached_tokens=0, chunks=[])
    # progress seen on a message without a step record is kept for the next step record
    assert b._on_snapshot(snapshot(waiting=[WaitingRequest("p1", 2000, 976), WaitingRequest("x", 30, 30)])) == []
    assert b.state().queue_prompt_tokens == [976, 30]
    assert b._on_snapshot(snapshot(waiting=[WaitingRequest("p1", 2000, 976)], step_record=rec)) == [("p1", 1024, 0)]
    assert b._on_snapshot(snapshot(waiting=[WaitingRequest("p1", 2000, 0)], step_record=rec)) == []  # reported once
    b.abort("p1")
    await asyncio_drain()


async def test_a_prefill_nodes_later_chunks_are_predicted_with_the_context_they_attend_over():
    """A 2,000-token keep-path prompt runs as two 1,024-token steps on a prefill node; the second
    attends over the first 1,024 tokens. Its step record's prediction (and the agent's record,
    from ``prefill_chunks``) must use that context: predicted without it, the node's live steps
    looked ~1.3x slower than their profile and the run's step scale was wrong by that much."""
    b = VllmBackend("prefill", MODEL, "http://127.0.0.1:1", "ipc:///tmp/none")
    b.add_prefill(req("p1", prompt=2000, ids=[3] * 2000))
    b.add_prefill(req("p2", prompt=300, ids=[4] * 300))
    first = StepRecord(step=6, started_unix_ms=1.0, wall_ms=400.0, prefill_tokens=1024, decode_count=0, kv_tokens=0,
                       cached_tokens=0, chunks=[], first_scheduled=["p1"], prefills=[PrefillChunk("p1", 1024, 0)])
    started = b._on_snapshot(snapshot(waiting=[WaitingRequest("p1", 2000, 976)], step_record=first))
    out = step_output(first, b._reqs, started, MODEL)
    assert out.prefill_chunks == (("p1", 1024, 0),) and out.predicted_ms == pytest.approx(MODEL.step_ms(0, 0, 1024, 0))
    second = StepRecord(step=7, started_unix_ms=2.0, wall_ms=500.0, prefill_tokens=1024, decode_count=0, kv_tokens=0,
                        cached_tokens=0, chunks=[], first_scheduled=["p2"],
                        prefills=[PrefillChunk("p1", 976, 1024), PrefillChunk("p2", 48, 0)])
    started = b._on_snapshot(snapshot(waiting=[WaitingRequest("p2", 300, 252)], step_record=second))
    out = step_output(second, b._reqs, started, MODEL)
    assert out.prefill_chunks == (("p1", 976, 1024), ("p2", 48, 0))  # each request once, with its context
    c = 976 * 1024 / 1024
    assert out.predicted_ms == pytest.approx(MODEL.step_ms(0, 0, 1024, c))
    assert MODEL.step_ms(0, 0, 1024, c) > 1.05 * MODEL.step_ms(0, 0, 1024, 0)
    # a record from a plugin without the field: the started prefills, as before
    old = StepRecord(step=8, started_unix_ms=3.0, wall_ms=1.0, prefill_tokens=10, decode_count=0, kv_tokens=0,
                     cached_tokens=0, chunks=[])
    assert step_output(old, b._reqs, [("p2", 10, 0)], MODEL).prefill_chunks == (("p2", 10, 0),)
    for rid in ("p1", "p2"):
        b.abort(rid)
    await asyncio_drain()


async def test_a_prefill_starts_when_vllm_schedules_it_not_when_it_is_submitted():
    """A P leg still on its way to vLLM's scheduler is in no waiting list: that is queueing, not a
    start (the live prefill queue read ~50 ms and vLLM's own queue counted as execution). It starts
    at the step whose record names it first scheduled, even when that one step computed it all."""
    b = VllmBackend("prefill", MODEL, "http://127.0.0.1:1", "ipc:///tmp/none")
    b.add_prefill(req("p1", prompt=900, ids=[3] * 900))
    b.add_prefill(req("p2", prompt=500, ids=[4] * 500))
    idle = StepRecord(step=6, started_unix_ms=1.0, wall_ms=30.0, prefill_tokens=1024, decode_count=0, kv_tokens=0,
                      cached_tokens=0, chunks=[], first_scheduled=["other"])
    assert b._on_snapshot(snapshot(waiting=[WaitingRequest("other", 2000, 976)], step_record=idle)) == []
    assert not b._reqs["p1"].started and not b._reqs["p2"].started
    both = StepRecord(step=7, started_unix_ms=2.0, wall_ms=30.0, prefill_tokens=1024, decode_count=0, kv_tokens=0,
                      cached_tokens=0, chunks=[], first_scheduled=["p1", "p2"])
    # p1 prefilled in this one step (no longer waiting), p2 partly (124 of 500 computed)
    assert b._on_snapshot(snapshot(waiting=[WaitingRequest("p2", 500, 376)], step_record=both)) == [
        ("p1", 900, 0), ("p2", 124, 0)]
    for rid in ("p1", "p2"):
        b.abort(rid)
    await asyncio_drain()


async def test_remote_decode_without_kv_transfer_params_is_refused():
    b = VllmBackend("decode", MODEL, "http://127.0.0.1:1", "ipc:///tmp/none")
    with pytest.raises(EngineApiError, match="kv_transfer_params"):
        b.add_remote_decode(req(ids=[1]), None)
    with pytest.raises(EngineApiError, match="no prompt"):
        b.add_deflected(req(), [10])


async def test_a_late_state_stream_is_slow_not_dead_while_the_server_answers_health():
    """Issue 10 on vLLM: a stale stream alone refuses nothing the server can still take; a server
    that does not answer (here: nothing listens) is unavailable. Real HTTP server, real socket."""
    import time

    from aiohttp import web
    from aiohttp.test_utils import TestServer

    health = {"status": 200}

    async def on_health(_request):
        return web.Response(status=health["status"])

    app = web.Application()
    app.router.add_get("/health", on_health)
    async with TestServer(app) as server:
        b = VllmBackend("decode", MODEL, str(server.make_url("")), "ipc:///tmp/none", stale_after_ms=50)
        assert await b.confirm_available(1.0) is False  # not ready: the model list never answered
        b._ready.set()
        b._on_snapshot(snapshot())
        assert b.available and await b.confirm_available(1.0)
        b._snap_mono = time.monotonic() - 1.0  # the last snapshot is 1 s old: stale
        assert not b.available
        assert await b.confirm_available(1.0) is True
        health["status"] = 503
        assert await b.confirm_available(1.0) is False
        await b.http.close()
    dead = VllmBackend("decode", MODEL, "http://127.0.0.1:1", "ipc:///tmp/none", stale_after_ms=50)
    dead._ready.set()
    dead._on_snapshot(snapshot())
    dead._snap_mono = time.monotonic() - 1.0
    assert await dead.confirm_available(1.0) is False
    await dead.http.close()


async def asyncio_drain() -> None:
    import asyncio

    await asyncio.sleep(0)  # let cancelled request tasks finish


def test_agent_config_requires_the_engine_url_and_state_stream_for_vllm():
    AgentConfig(node_id="decode-0", role="decode", backend="vllm", engine_url="http://127.0.0.1:8100",
                engine_state_addr="ipc:///tmp/x.sock")
    with pytest.raises(ConfigError, match="KAIROS_ENGINE_URL"):
        AgentConfig(node_id="decode-0", role="decode", backend="vllm", engine_state_addr="ipc:///tmp/x.sock")
    with pytest.raises(ConfigError, match="KAIROS_ENGINE_STATE_ADDR"):
        AgentConfig(node_id="decode-0", role="decode", backend="vllm", engine_url="http://127.0.0.1:8100",
                    engine_state_addr="/tmp/x.sock")


def vllm_plan(tmp_path, monkeypatch) -> list:
    """``kairos up --engine vllm`` 1P1D's children (:func:`kairos.cli.up.plan`; this python stands in
    for the vLLM one, nothing is started)."""
    from kairos.cli.up import UpOptions, plan

    monkeypatch.setenv("KAIROS_VLLM_PYTHON", sys.executable)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tokenizer.json").write_text("{}")
    opts = UpOptions(prefill=1, decode=1, dispatchers=1, engine="vllm", model_dir=str(tmp_path / "model"),
                     profile="cpu-tiny-vllm", served_model="tiny")
    return plan(opts, "nats://127.0.0.1:4222", tmp_path / "logs", run_dir=tmp_path)


def test_kairos_up_vllm_plan_puts_a_server_beside_each_agent(tmp_path, monkeypatch):
    from kairos.cli.up import ENGINE_NICE, UpOptions, plan
    from kairos.runtime.envconfig import from_env
    from kairos.services.ingress.config import IngressConfig

    children = vllm_plan(tmp_path, monkeypatch)
    by = {c.name: c for c in children}
    nixl = set()
    for k, node in enumerate(("prefill-0", "decode-0")):
        eng, agent = by[f"vllm-{node}"], by[node]
        argv = eng.argv
        # each engine's whole process tree on its own core (1P1D on >= 2 cores), not niced below
        # the control plane (at nice 15 any nice-0 process took ~97 % of the engine's core)
        assert argv[:3] == ["taskset", "-c", str(k % (os.cpu_count() or 1))] and ENGINE_NICE == 0
        assert eng.env["VLLM_CPU_OMP_THREADS_BIND"] == argv[2]
        # the quiet-idle plugin (kairos.engines.vllm.plugin.general) is on: NIXL progress thread delay, no shm busy loop
        assert eng.env["KAIROS_NIXL_PROGRESS_DELAY_US"] == "1000" and eng.env["KAIROS_VLLM_MQ_BUSY_LOOP_S"] == "0"
        assert str(ROOT / "kairos" / "engines" / "vllm" / "plugin" / "plugins") in eng.env["PYTHONPATH"].split(os.pathsep)
        argv = argv[3:]
        assert argv[0] == sys.executable and argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
        flag = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}
        assert flag["--scheduler-cls"] == "kairos.engines.vllm.plugin.scheduler.KairosScheduler"
        assert json.loads(flag["--kv-transfer-config"])["kv_role"] == "kv_both"
        assert flag["--dtype"] == "float32" and flag["--max-model-len"] == "2048" and "--enforce-eager" in argv
        assert flag["--served-model-name"] == "tiny"
        cfg = from_env(AgentConfig, env=agent.env)
        assert cfg.backend == "vllm" and cfg.engine_url == eng.endpoint == f"http://127.0.0.1:{flag['--port']}"
        assert cfg.kv_handoff_timeout_s == 10.0
        assert cfg.engine_state_addr == eng.env["KAIROS_ENGINE_STATE_ADDR"]
        assert eng.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
        nixl.add(eng.env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
        assert children.index(eng) < children.index(agent)
    assert len(nixl) == 2
    from kairos.services.state_aggregator.config import AggregatorConfig
    assert from_env(AggregatorConfig, env=by["state_aggregator"].env).stale_after_ms == 2000.0
    # vLLM-CPU engines: the ingress refuses what would kill them, whatever the route (issue 16 §5)
    assert from_env(IngressConfig, env=by["ingress"].env).engine_kind == "vllm-cpu"
    ing = from_env(IngressConfig, env=by["ingress"].env)
    assert ing.tokenizer_path == str(tmp_path / "model" / "tokenizer.json") and ing.served_model == "tiny"
    with pytest.raises(ValueError, match="--model"):
        plan(UpOptions(engine="vllm"), "nats://127.0.0.1:4222", tmp_path, run_dir=tmp_path)


async def test_a_keep_path_decodes_last_prompt_token_is_not_a_prefill_of_the_decode_node():
    """vLLM computes a remote decode's last prompt token after the KV pull, and the plugin's record
    names it among the step's prefills (1 token over the prompt's context). The decode agent must
    keep the request's cached tokens from the handoff (what the prefill node served from its cache,
    reported in the usage) and start no prefill clock for it; a deflected prefill's first chunk
    still starts its clock with the prefix-cache hit it ran after."""
    from opentelemetry.trace import INVALID_SPAN

    from kairos.core.vocabulary import RequestPhase, RequestRole
    from kairos.engines.base import StepOutput
    from kairos.services.node_agent.agent import NodeAgent
    from kairos.services.node_agent.config import AgentConfig
    from kairos.services.node_agent.request import NodeRequest
    from kairos.services.node_agent.tracing import RequestSpans

    agent = NodeAgent(AgentConfig(node_id="decode-0", role="decode", nats_url="nats://127.0.0.1:1", metrics_port=-1),
                      model=MODEL)
    agent.reqs["rd"] = NodeRequest(req=req("rd", prompt=2000, ids=[3] * 2000), role=RequestRole.REMOTE_DECODE,
                                   node="decode-0", phase=RequestPhase.DECODING, received_ms=0.0,
                                   spans=RequestSpans(main=INVALID_SPAN), cached_tokens=256)
    agent.reqs["df"] = NodeRequest(req=req("df", prompt=600, ids=[4] * 600), role=RequestRole.DEFLECT, node="decode-0",
                                   phase=RequestPhase.DEFLECTED_PREFILL, received_ms=0.0,
                                   spans=RequestSpans(main=INVALID_SPAN))
    out = StepOutput(step=9, started_unix_ms=123.0, wall_ms=40.0, predicted_ms=40.0, batch_size=2, kv_tokens=4000,
                     prefill_tokens=129, prefill_chunks=(("rd", 1, 1999), ("df", 128, 64)), deflected_chunk=None,
                     tokens=(), first_tokens=(), prefill_done=(), finished=())
    await agent.on_step(out)
    rd, df = agent.reqs["rd"], agent.reqs["df"]
    assert (rd.cached_tokens, rd.prefill_start_ms) == (256, None)
    assert (df.cached_tokens, df.prefill_start_ms) == (64, 123.0)
    agent.steps.flush()
