"""Integration fixtures: a real nats-server (JetStream, free port, temp store) per test module, and
the whole Kairos stack run in-process as asyncio tasks against it (fast latency profile).

No mocking of the bus; waits are on conditions with deadlines, never fixed sleeps.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import aiohttp
import nats
import pytest

from kairos.cli.up import free_port, stop_process, wait_listening
from kairos.services.dispatcher.config import DispatcherConfig
from kairos.services.dispatcher.service import Dispatcher
from kairos.services.ingress.config import IngressConfig
from kairos.services.ingress.service import Ingress
from kairos.services.node_agent.agent import NodeAgent
from kairos.services.node_agent.config import AgentConfig
from kairos.services.state_aggregator.config import AggregatorConfig
from kairos.services.state_aggregator.service import StateAggregator
from kairos.contracts import subjects as S
from kairos.core.model.latency import LatencyModel, load_profile

NATS_BIN = Path(sys.executable).parent / "nats-server"


def fast_model(scale: float = 0.25, link_scale: float = 0.25) -> LatencyModel:
    """The default profile with every latency scaled by ``scale`` (fast tests, same shapes)."""
    d = load_profile().to_dict()
    d["name"], d["version"] = "test-fast", f"x{scale}"
    for k in ("prefill", "decode"):
        d[k]["intercept_ms"] *= scale
        d[k]["coef"] = [c * scale for c in d[k]["coef"]]
    d["mixed_delta"]["coef"] = [c * scale for c in d["mixed_delta"]["coef"]]
    for link in d["kv_transfer"]["links"].values():
        link["bandwidth_gb_s"] /= link_scale
        link["setup_ms"] *= link_scale
    return LatencyModel.from_dict(d)


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory) -> str:
    """A real nats-server with JetStream for this module; torn down afterwards."""
    store = tmp_path_factory.mktemp("js")
    with running_nats(store) as port:
        yield f"nats://127.0.0.1:{port}"
    shutil.rmtree(store, ignore_errors=True)


@contextmanager
def running_nats(store: Path, *extra: str, env: dict[str, str] | None = None):
    """Start ``nats-server -js`` on a free loopback port with its store in ``store``, the
    ``extra`` arguments (``-c CONF``, ``-l LOG``…) and environment ``env`` (default: ours), wait
    until it accepts connections (10 s), yield the port, then stop it. Raises RuntimeError when it
    exits or never listens. (Connect only once it listens: nats-py's ``connect`` with
    ``max_reconnect_attempts=0`` retries a refused first connection forever.)"""
    port = free_port()
    store.mkdir(parents=True, exist_ok=True)
    out = open(store.parent / f"{store.name}.nats-server.out", "w+b")
    proc = subprocess.Popen([str(NATS_BIN), *extra, "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(store)],
                            stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        if not wait_listening(proc, port):
            out.seek(0)
            raise RuntimeError(f"nats-server did not start (exit code {proc.poll()}): "
                               f"{out.read()[-2000:].decode(errors='replace')}")
        yield port
    finally:
        stop_process(proc)
        out.close()


#: the test harness's own NATS user on a server with the Kairos roles (:func:`secure_server`): no
#: permission limits, so it can reset the bus between tests; no Kairos service uses it
ADMIN_USER = "kairos-test-admin"


@contextmanager
def secure_server(d: Path, nodes: list[str]):
    """A nats-server with JetStream and the per-role users ``kairos/contracts/permissions.py`` generates for
    ``nodes`` (what ``kairos up`` runs), plus :data:`ADMIN_USER`; logs to ``d/nats.log``. Yields
    ``(url, passwords)`` (``passwords[user]``, the admin's included)."""
    from kairos.contracts.permissions import GeneratedAuth, new_password

    auth = GeneratedAuth.for_nodes(nodes)
    passwords = {**auth.passwords, ADMIN_USER: new_password()}
    conf = auth.server_config().replace("\n  ]\n}", f'\n    {{user: "{ADMIN_USER}", password: "{passwords[ADMIN_USER]}"}}'
                                                     "\n  ]\n}", 1)
    assert ADMIN_USER in conf
    (d / "nats.conf").write_text(conf)
    with running_nats(d / "js", "-c", str(d / "nats.conf"), "-l", str(d / "nats.log")) as port:
        yield f"nats://127.0.0.1:{port}", passwords


async def poll_health(base: str, http: aiohttp.ClientSession, want_status: int, timeout: float,
                      code: str | None = None) -> dict:
    """GET /health until it answers ``want_status`` (and lists reason ``code``), else fail."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        async with http.get(base + "/health") as r:
            last = (r.status, await r.json())
        if last[0] == want_status and (code is None or code in [x["code"] for x in last[1]["reasons"]]):
            return last[1]
        if time.monotonic() > deadline:
            raise AssertionError(f"/health never answered {want_status} {code or ''}: {last}")
        await asyncio.sleep(0.05)


async def wait_until(pred: Callable[[], Any], timeout: float, what: str = "condition", every: float = 0.01) -> Any:
    """Poll ``pred`` every ``every`` s until truthy (returns its value) or fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(every)


async def reset_bus(url: str, passwords: dict[str, str] | None = None) -> None:
    """Delete Kairos' streams and buckets so each test starts from an empty bus (as
    :data:`ADMIN_USER` with ``passwords``)."""
    creds = {"user": ADMIN_USER, "password": passwords[ADMIN_USER]} if passwords else {}
    nc = await nats.connect(url, **creds)
    js = nc.jetstream()
    for name in (f"KV_{S.VIEW_BUCKET}", f"KV_{S.RESERVATION_BUCKET}", f"KV_{S.REQUESTS_BUCKET}"):
        try:
            await js.delete_stream(name)
        except Exception:
            pass
    await nc.close()


@dataclass
class Stack:
    url: str
    ingress: Ingress
    aggregator: StateAggregator
    dispatchers: list[Dispatcher]
    agents: dict[str, NodeAgent]
    http: aiohttp.ClientSession
    base: str
    dead: set[str] = field(default_factory=set)

    async def kill_agent(self, node: str) -> None:
        """Crash a node agent: its connection drops, nothing is drained or announced."""
        await self.agents[node].close(drain=False)
        self.dead.add(node)

    async def restart_agent(self, node: str) -> NodeAgent:
        """Start a new incarnation of a crashed node agent (the same configuration and model)."""
        old = self.agents[node]
        new = NodeAgent(old.cfg, model=old.model)
        await new.start()
        self.agents[node] = new
        self.dead.discard(node)
        return new

    async def complete(self, prompt: Any = "hello world", max_tokens: int = 4, stream: bool = False,
                       chat: bool = False, **extra) -> tuple[int, Any]:
        """POST a completion; returns (status, JSON body) or (status, list of SSE data payloads)."""
        url = self.base + ("/v1/chat/completions" if chat else "/v1/completions")
        body = {"model": "kairos-emulated", "max_tokens": max_tokens, "stream": stream, **extra}
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        async with self.http.post(url, json=body) as r:
            if stream and r.status == 200 and r.content_type == "text/event-stream":
                events = []
                async for line in r.content:
                    line = line.strip()
                    if line.startswith(b"data: "):
                        events.append(line[6:].decode())
                return r.status, events
            return r.status, await r.json()


@asynccontextmanager
async def stack(url: str, prefill: int = 2, decode: int = 2, dispatchers: int = 2, policy: str = "kairos",
                model: LatencyModel | None = None, period_ms: float = 50.0, request_timeout_s: float = 20.0,
                idle_timeout_s: float = 10.0, trace_file: str | None = None, span_exporter: Any = None,
                metrics: bool = False, max_deflections: int = 1, ingress_overrides: dict | None = None,
                passwords: dict[str, str] | None = None, agent_overrides: dict | None = None,
                **dispatcher_overrides):
    """The whole stack in this event loop; yields a :class:`Stack` once every node is in the view.

    ``span_exporter``: also export every service's spans synchronously to it (e.g. an OTel
    ``InMemorySpanExporter``); ``metrics``: serve each non-HTTP service's /metrics on a free port;
    ``max_deflections``: deflection slots per decode node (agents and dispatchers alike).
    ``ingress_overrides``, ``agent_overrides``: extra :class:`IngressConfig` / every agent's
    :class:`AgentConfig` fields. ``passwords``: log every service
    in as its role (a :func:`secure_server`'s).
    """
    await reset_bus(url, passwords)

    def cred(user: str) -> dict:
        out = {"nats_user": user, "nats_password": passwords[user]} if passwords else {}
        return out

    model = model or fast_model()
    mport = 0 if metrics else -1

    def instrument(svc):
        if span_exporter is not None:
            from opentelemetry.sdk.trace.export import SimpleSpanProcessor
            svc.tel.provider.add_span_processor(SimpleSpanProcessor(span_exporter))
        return svc

    agg = instrument(StateAggregator(AggregatorConfig(nats_url=url, state_period_ms=period_ms, metrics_port=mport,
                                                      trace_file=trace_file, **cred("aggregator"))))
    await agg.start()
    agents: dict[str, NodeAgent] = {}
    for role, n in (("prefill", prefill), ("decode", decode)):
        for i in range(n):
            a = instrument(NodeAgent(AgentConfig(node_id=f"{role}-{i}", role=role, nats_url=url,
                                                 state_period_ms=period_ms, metrics_port=mport, trace_file=trace_file,
                                                 max_deflections=max_deflections, **cred(f"agent-{role}-{i}"),
                                                 **(agent_overrides or {})),
                                     model=model))
            await a.start()
            agents[a.cfg.node_id] = a
    disp = []
    for i in range(dispatchers):
        d = instrument(Dispatcher(DispatcherConfig(replica_id=f"dispatcher-{i}", nats_url=url, policy=policy,
                                                   metrics_port=mport, trace_file=trace_file,
                                                   max_deflections_per_node=max_deflections, **cred("dispatcher"),
                                                   **dispatcher_overrides),
                                  model=model))
        await d.start()
        disp.append(d)
    ing = instrument(Ingress(IngressConfig(nats_url=url, port=0, request_timeout_s=request_timeout_s,
                                           idle_timeout_s=idle_timeout_s, trace_file=trace_file,
                                           **cred("ingress"), **(ingress_overrides or {}))))
    await ing.start()
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
    st = Stack(url=url, ingress=ing, aggregator=agg, dispatchers=disp, agents=agents, http=http,
               base=f"http://127.0.0.1:{ing.port}")
    try:
        await wait_until(lambda: all(v and {n.node for n in v.nodes if not n.stale} >= set(agents)
                                     for v in [d.view for d in disp] + [ing.view]),
                         10, "every node in every dispatcher's and the ingress's view")
        yield st
    finally:
        await http.close()
        await ing.close()
        for d in disp:
            await d.close()
        for nid, a in agents.items():
            if nid not in st.dead:
                await a.close()
        await agg.close()


async def get_record(st: Stack, rid: str, need: Callable[[dict], bool] = lambda r: True, timeout: float = 5.0) -> dict:
    """GET /v1/requests/{rid} until ``need(record)`` holds (records are written asynchronously)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        async with st.http.get(f"{st.base}/v1/requests/{rid}") as r:
            last = (r.status, await r.json())
        if last[0] == 200 and need(last[1]):
            return last[1]
        if time.monotonic() > deadline:
            raise AssertionError(f"record of {rid} never satisfied the condition: {last}")
        await asyncio.sleep(0.02)


async def post_openai(st: Stack, body: dict, chat: bool = False, model: str = "kairos-emulated"):
    """POST an OpenAI request (``model`` added) to the stack's ingress: (status, headers, the JSON body
    or, for a stream, its chunks decoded — the closing ``[DONE]`` checked and dropped)."""
    url = st.base + ("/v1/chat/completions" if chat else "/v1/completions")
    async with st.http.post(url, json={"model": model, **body}) as r:
        if r.content_type == "text/event-stream":
            events = [line.strip()[6:].decode() async for line in r.content if line.strip().startswith(b"data: ")]
            assert events[-1] == "[DONE]"
            return r.status, r.headers, [json.loads(e) for e in events[:-1]]
        return r.status, r.headers, await r.json()


def components_known(rec: dict) -> bool:
    m = rec["measured"]
    return all(m[k] is not None for k in ("ttft_ms", "prefill_queue_ms", "prefill_exec_ms", "kv_transfer_ms",
                                          "decode_queue_ms"))
