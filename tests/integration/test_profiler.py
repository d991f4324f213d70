"""`kairos profile` round trip and the model/correction paths on a real bus.

* Round trip: an emulated decode node whose steps follow a *hidden* truth (another artifact than the
  one it predicts with, 15 % slower on top) is profiled as separate processes (bundled nats-server,
  node agent) through the same code as ``kairos profile --emulated``; the fitted model must recover
  the truth within 3 % MAPE on compositions it was not fitted on.
* Hot reload: an artifact put under ``kairos_models/latency.current`` becomes the model the
  dispatchers decide with (and record); an invalid one is ignored.
* Corrections: step records on ``kairos.steps.<node>`` whose actual time is 1.3 × the prediction
  reach every dispatcher's view as that node's correction.
* ``python -m kairos.services.profiler`` (the service's own command) profiles a node of a running
  cluster, writes and publishes the artifact.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import nats
import numpy as np
import pytest

from kairos.cli.profile import ProfileOptions, run_profile
from kairos.services.profiler.service import publish_model
from kairos.contracts import subjects as S
from kairos.runtime.bus import flush_barrier
from kairos.core.model.latency import LatencyModel, load_profile
from kairos.core.cluster.routing import build_snapshot
from kairos.contracts.wire import InferenceRequest, StepRecordEvent, encode, now_ms
from tests.integration.conftest import fast_model, stack, wait_until

BELIEF = load_profile()


def hidden_truth(tmp_path):
    """Another form than the node's belief: a slower fixed cost per step and per decode, a smaller
    K cost, dearer chunks. (Steps of 70+ ms: a busy CI machine's event-loop lateness, ~1 ms, stays
    a small fraction of each measurement.)"""
    d = BELIEF.to_dict()
    d["name"], d["version"] = "hidden-truth", "1"
    d["decode"]["intercept_ms"] = 60.0
    d["decode"]["coef"] = [0.4, 1.0e-5]
    d["prefill"]["intercept_ms"] = 30.0
    d["mixed_delta"]["coef"] = [0.03, 5e-6, 2e-5, 1e-8]
    path = tmp_path / "hidden.json"
    path.write_text(json.dumps(d))
    return load_profile(path), path


def test_profile_an_emulated_node_recovers_its_hidden_truth_within_3_percent(tmp_path):
    truth, path = hidden_truth(tmp_path)
    scale = 1.15
    out = tmp_path / "fitted.json"
    fitted = run_profile(ProfileOptions(emulated=True, truth_profile=str(path), truth_scale=scale, grid="quick",
                                        name="roundtrip", version="t1", out=str(out), publish=False, max_mape=10.0,
                                        quiet=True))
    assert load_profile(out).to_dict() == json.loads(json.dumps(fitted.to_dict()))
    # independent check: compositions inside the quick grid's ranges, not the sampled points
    rng = np.random.default_rng(0)
    t, f = [], []
    for _ in range(300):
        kind = rng.integers(3)
        if kind == 0:
            B, K, p, c = 0, 0, int(rng.integers(256, 2049)), int(rng.integers(0, 4)) * 512
        elif kind == 1:
            B = int(rng.integers(4, 17))
            B, K, p, c = B, B * int(rng.integers(1024, 1100)), 0, 0
        else:
            B = int(rng.integers(4, 17))
            B, K, p, c = B, B * int(rng.integers(1024, 1100)), int(rng.integers(240, 1009)), int(rng.integers(0, 4000))
        t.append(truth.step_ms(B, K, p, c) * scale)
        f.append(fitted.step_ms(B, K, p, c))
    err = np.abs(np.array(f) - np.array(t)) / np.array(t) * 100
    print(f"MAPE of the fitted model vs the hidden truth: {err.mean():.2f} %")
    assert err.mean() <= 3.0, f"MAPE vs the hidden truth {err.mean():.2f} %"
    # ... and it is not the model the node predicted with (the test can tell them apart)
    belief = [BELIEF.step_ms(0, 0, 1024, 0), BELIEF.step_ms(16, 16 * 1024, 0, 0)]
    assert fitted.step_ms(16, 16 * 1024, 0, 0) != pytest.approx(belief[1], rel=0.05)
    meta = fitted.metadata
    for key in ("hardware", "engine", "model", "date", "grid", "steps_recorded", "fit"):
        assert key in meta, key
    # each prefill composition's first step was left out of the fit (none of the samples it counts)
    assert 0 < meta["warmup_steps"] < meta["steps_recorded"]
    assert sum(meta["fit"]["samples"].values()) + meta["fit"]["rejected"]["invalid"] == \
        meta["steps_recorded"] - meta["warmup_steps"]
    assert set(meta["fit"]["samples"]) == {"prefill", "decode", "mixed"}
    assert all(v is not None and v <= 10.0 for v in fitted.mape.values())


async def test_dispatchers_hot_reload_the_published_model_and_ignore_a_bad_one(nats_url):
    async with stack(nats_url, prefill=1, decode=1, dispatchers=2) as st:
        old = st.dispatchers[0].model.artifact_version
        d = fast_model().to_dict()
        d["name"], d["version"] = "reloaded", "v2"
        new = LatencyModel.from_dict(d)
        nc = await nats.connect(nats_url)
        try:
            await publish_model(nc, new)
            await wait_until(lambda: all(x.model.artifact_version == "reloaded@v2" for x in st.dispatchers), 10,
                             "every dispatcher on the published model")
            assert old != "reloaded@v2"
            status, body = await st.complete("hello there", max_tokens=2)
            assert status == 200, body
            rec = await wait_for_decision(st, body["id"])
            assert rec["routing"]["model_version"] == "reloaded@v2"
            kv = await nc.jetstream().key_value(S.MODELS_BUCKET)
            await kv.put(S.CURRENT_MODEL_KEY, b'{"schema_version": 1, "name": "broken"}')
            await kv.put(S.model_key("probe"), b"{}")  # an unrelated key: not watched
            await publish_model(nc, LatencyModel.from_dict({**d, "version": "v3"}))
            await wait_until(lambda: all(x.model.artifact_version == "reloaded@v3" for x in st.dispatchers), 10,
                             "the next valid artifact after an invalid one")
        finally:
            await nc.close()


async def wait_for_decision(st, rid: str) -> dict:
    from tests.integration.conftest import get_record

    return await get_record(st, rid, lambda r: r.get("routing") is not None)


async def test_step_records_become_corrections_in_every_dispatchers_view(nats_url):
    async with stack(nats_url, prefill=1, decode=1, dispatchers=2, policy="kairos+") as st:
        nc = await nats.connect(nats_url)
        try:
            rng = np.random.default_rng(1)
            for i in range(200):
                pred = 40.0 + 10 * rng.random()
                await nc.publish(S.steps_subject("prefill-0"), encode(StepRecordEvent(
                    node="prefill-0", role="prefill", step=i, started_unix_ms=now_ms(), wall_ms=1.3 * pred,
                    predicted_ms=pred, batch_size=0, kv_tokens=0, prefill_tokens=512)))
            await flush_barrier(nc)

            def corr():
                out = []
                for d in st.dispatchers:
                    n = next((n for n in (d.view.nodes if d.view else []) if n.node == "prefill-0"), None)
                    out.append(n.correction if n is not None else None)
                return out
            # the node's real (emulated, exact) steps keep arriving too: wait for the 1.3 to dominate
            await wait_until(lambda: all(c is not None and c.samples >= 100 and c.bias > 1.2 for c in corr()), 10,
                             "the correction in every dispatcher's view")
            req = InferenceRequest(request_id="r1", model="m", prompt_tokens=100, max_tokens=4,
                                   created_unix_ms=now_ms(), deadline_unix_ms=now_ms() + 1e4)
            # the policy's input carries it (a view where a heartbeat came late on a loaded host has a
            # stale node and no snapshot: the next one has it again)
            snap = await wait_until(lambda: build_snapshot(req, st.dispatchers[0].view, {}, {}, now_ms()), 10,
                                    "a snapshot with every node routable")
            assert snap.prefill_nodes[0].step_bias > 1.2
        finally:
            await nc.close()


async def test_trace_replay_mixes_deflections_and_handoffs_and_leaves_the_node_idle(nats_url):
    from kairos.services.node_agent.agent import NodeAgent
    from kairos.services.node_agent.config import AgentConfig
    from kairos.services.profiler.service import Profiler
    from kairos.core.model.profiling import ProfileGrid
    from kairos.core.workload.workloads import generate

    agent = NodeAgent(AgentConfig(node_id="decode-7", role="decode", nats_url=nats_url, metrics_port=-1,
                                  state_period_ms=50.0), model=fast_model())
    await agent.start()
    nc = await nats.connect(nats_url)
    try:
        wl = generate("bursty", 6, 4, seed=2)
        # the replay alone (the grid is covered by the round trip): a grid without points
        empty = ProfileGrid(batch_sizes=(), contexts=(), chunks=(), prefill_chunks=())
        prof = Profiler(nc, "decode-7", empty)
        counts = (await asyncio.wait_for(prof.run(replay=wl), 60)).replay_counts
        assert sum(counts.values()) == len(wl) and counts["deflected"] >= 1 and counts["handed_off"] >= 1
        evs = prof.result.events
        assert any(e.batch_size > 0 and e.prefill_tokens > 0 for e in evs)  # mixed steps
        assert any(e.batch_size > 0 and e.prefill_tokens == 0 for e in evs)  # decode-only steps
        assert prof.state is not None and prof.state.running == 0 and not prof._live
    finally:
        await nc.close()
        await agent.close()


async def test_the_profiler_receives_the_record_of_every_step_the_engine_ran(nats_url):
    """Heartbeats every 10 ms, step records batched for up to 50 ms: the idle heartbeat the
    profiler ends on must not overtake the last steps' records (the agent sends them first).
    Truth: the emulated engine's own step counter."""
    from kairos.services.node_agent.agent import NodeAgent
    from kairos.services.node_agent.config import AgentConfig
    from kairos.services.profiler.service import Profiler
    from kairos.core.model.profiling import ProfileGrid

    agent = NodeAgent(AgentConfig(node_id="decode-8", role="decode", nats_url=nats_url, metrics_port=-1,
                                  state_period_ms=10.0), model=fast_model(scale=0.05))
    await agent.start()
    nc = await nats.connect(nats_url)
    try:
        grid = ProfileGrid(batch_sizes=(), contexts=(), chunks=(), prefill_chunks=(64, 128), chunk_steps=3)
        prof = Profiler(nc, "decode-8", grid)
        run = await asyncio.wait_for(prof.run(), 60)
        steps = [e.step for e in run.events]
        assert agent.backend.engine.steps > 0
        assert steps == list(range(agent.backend.engine.steps)), (len(steps), agent.backend.engine.steps)
    finally:
        await nc.close()
        await agent.close()


async def test_a_profile_fails_soon_with_what_it_collected_when_the_node_stops_heartbeating(nats_url):
    """The node's agent crashes mid-grid: the run ends with a ProfileRunError naming the silence within
    a few heartbeat-loss periods — not after the per-step timeouts of the phase it was in (minutes)
    — and carries the step records collected until then."""
    from kairos.services.node_agent.agent import NodeAgent
    from kairos.services.node_agent.config import AgentConfig
    from kairos.services.profiler.service import ProfileRunError, Profiler
    from kairos.core.model.profiling import ProfileGrid

    agent = NodeAgent(AgentConfig(node_id="decode-9", role="decode", nats_url=nats_url, metrics_port=-1,
                                  state_period_ms=50.0), model=fast_model())
    await agent.start()
    nc = await nats.connect(nats_url)
    try:
        grid = ProfileGrid(batch_sizes=(), contexts=(), chunks=(), prefill_chunks=(256, 512), chunk_steps=5, repeats=50)
        prof = Profiler(nc, "decode-9", grid, step_timeout_s=120.0, heartbeat_loss_s=1.0)
        run = asyncio.ensure_future(prof.run())
        await wait_until(lambda: len(prof.result.events) >= 3, 30, "the first steps recorded")
        await agent.close(drain=False)  # crash: no goodbye, no more heartbeats
        with pytest.raises(ProfileRunError, match="sent no heartbeat") as err:
            await asyncio.wait_for(run, 20)
        assert err.value.partial is prof.result and len(err.value.partial.events) >= 3
    finally:
        await nc.close()
        await agent.close()


async def test_the_grid_measures_long_context_chunks_within_the_nodes_context(nats_url):
    """The testbed's live steps attend over long contexts: chunks the size of the step budget after
    a computed prefix, and a long deflected prompt's last small chunks. A prefill-only run longer
    than the node's context is shortened to it (its second chunk attends over the first) instead of
    skipped, and ``mixed_prefixes`` computes a prefix before the measured mixed chunks. Truth: the
    engine's own step records (B, prompt tokens, computed prefix per step)."""
    from kairos.services.node_agent.agent import NodeAgent
    from kairos.services.node_agent.config import AgentConfig
    from kairos.services.profiler.service import Profiler
    from kairos.core.model.profiling import ProfileGrid

    agent = NodeAgent(AgentConfig(node_id="decode-6", role="decode", nats_url=nats_url, metrics_port=-1,
                                  state_period_ms=10.0), model=fast_model(scale=0.05))
    await agent.start()
    nc = await nats.connect(nats_url)
    try:
        grid = ProfileGrid(batch_sizes=(2,), contexts=(64,), chunks=(64,), prefill_chunks=(512,), chunk_steps=3,
                           decode_dwell_steps=2, mixed_prefixes=(0, 600))
        run = await asyncio.wait_for(Profiler(nc, "decode-6", grid, max_model_len=1100).run(), 60)
        prefill_only = [e for e in run.events if e.batch_size == 0 and e.prefill_tokens > 0]
        # 3 × 512 > 1,099: one run of 1,099 tokens, chunks 512 (no prefix) and 512 + 75 after it
        assert any(e.prefill_tokens == 512 and e.prefill_cached == 0 for e in prefill_only)
        assert any(e.prefill_tokens == 512 and e.prefill_cached == 512 for e in prefill_only)
        assert max(e.prefill_cached for e in prefill_only) == 1024
        mixed = [e for e in run.events if e.batch_size >= 2 and e.prefill_tokens > 0]
        # the prefixed run's measured chunks (χ − B = 62 prompt tokens) attend over ≥ 600 tokens
        assert any(e.prefill_tokens == 62 and e.prefill_cached >= 600 for e in mixed)
        assert any(e.prefill_tokens == 62 and e.prefill_cached < 200 for e in mixed)  # and the unprefixed run's
    finally:
        await nc.close()
        await agent.close()


async def test_the_testbed_profile_records_every_step_of_every_node_while_the_replay_runs(nats_url):
    """``kairos profile --vllm --testbed``'s recorder: every step record both nodes publish while the
    replay (a blocking client in a thread) runs — and those the agents still batch after it returns
    — with nothing else. Truth: the records as the replay published them, on a real nats-server."""
    from kairos.cli.testbed_profile import record_steps

    def rec(node: str, step: int) -> StepRecordEvent:
        return StepRecordEvent(node=node, role="decode" if node.startswith("d") else "prefill", step=step,
                               started_unix_ms=float(step), wall_ms=10.0 + step, predicted_ms=9.0, batch_size=step % 3,
                               kv_tokens=100 * step, prefill_tokens=64 * (step % 2))

    sent = [rec(n, i) for i in range(1, 41) for n in ("decode-0", "prefill-0")]

    def replay() -> str:
        async def publish() -> None:
            nc = await nats.connect(nats_url)
            for k in range(0, len(sent), 8):  # batches, as the agents send them
                await nc.publish(S.steps_subject(sent[k].node), b"[" + b",".join(encode(e) for e in sent[k:k + 8]) + b"]")
            await nc.publish(S.steps_subject("decode-0"), b"not json")  # dropped, not fatal
            await nc.flush()
            await nc.close()
        asyncio.run(publish())
        return "replayed"

    got, result, idle = await record_steps(nats_url, None, replay, quiet_s=0.5)
    assert result == "replayed" and idle == {}
    key = lambda e: (e.node, e.step)  # noqa: E731
    assert sorted(got, key=key) == sorted(sent, key=key)


async def test_python_m_kairos_services_profiler_profiles_a_node_of_a_running_cluster(nats_url, tmp_path):
    """The service's own command (no CLI) on a running node: the grid run, the fit written where
    ``--out`` says with the provenance of that command line, the raw records beside it, the
    artifact published to ``kairos_models`` under its name and ``latency.current``. Truth: the
    node's own step records, the KV bucket as read back."""
    from kairos.services.node_agent.agent import NodeAgent
    from kairos.services.node_agent.config import AgentConfig

    agent = NodeAgent(AgentConfig(node_id="decode-4", role="decode", nats_url=nats_url, metrics_port=-1,
                                  state_period_ms=50.0), model=fast_model())
    await agent.start()
    out, records = tmp_path / "svc.json", tmp_path / "steps.jsonl"
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kairos.services.profiler", "--nats-url", nats_url, "--node", "decode-4",
            "--grid", "quick", "--name", "svc-profiled", "--version", "s1", "--out", str(out), "--records",
            str(records), "--max-mape", "1000", "--engine", "emulated (test)",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={k: v for k, v in os.environ.items() if not k.startswith("KAIROS_")})  # no login: an open server
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 180)
    finally:
        await agent.close()
    assert proc.returncode == 0, stderr.decode()
    fitted = load_profile(out)
    meta = fitted.metadata
    assert (fitted.name, fitted.version, meta["engine"], meta["node"], meta["grid"]["name"]) == \
        ("svc-profiled", "s1", "emulated (test)", "decode-4", "quick")
    assert meta["command"].startswith("python -m kairos.services.profiler --nats-url")
    assert meta["steps_recorded"] == len(records.read_text().splitlines()) > 0
    text = stdout.decode()
    assert f"wrote {out}" in text and "published KV kairos_models/latency.current" in text
    nc = await nats.connect(nats_url)
    try:
        kv = await nc.jetstream().key_value(S.MODELS_BUCKET)
        for key in (S.model_key("svc-profiled"), S.CURRENT_MODEL_KEY):
            assert json.loads((await kv.get(key)).value) == json.loads(out.read_text()), key
    finally:
        await nc.close()
