"""The ``faults`` tier: the real services as separate OS processes (started like ``kairos up`` does,
from :func:`kairos.cli.up.plan`), a real ``nats-server``, and faults injected by pid — SIGKILL, SIGSTOP /
SIGCONT, a restart on the same JetStream store — or by the dispatcher's ``KAIROS_FAULT_AT`` hook.

What every test counts, from independent sources:

* the clients: every request sent ends with a completion or an explicit error (``hung`` = no
  answer within the client's deadline), and a completion's text is exactly the emulated engine's
  output for ``max_tokens`` tokens in order (:func:`expected_text`) — tokens of two executions
  merged into one response would repeat words or exceed the count;
* the node agents' logs: ``job_accepted`` lines per bus request id across all nodes (a duplicate
  execution is a second line for one id).

Like ``kairos up``, every service logs in to NATS with its own role's credential, so everything a
fault path does on the bus (re-declaring after a reconnect, jobs sent by the ingress, heartbeats at the ingress) is
also checked against the permission table (``kairos/contracts/permissions.py``).

Waits poll a condition with a deadline; nothing sleeps as synchronisation.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import aiohttp
import pytest

from kairos.cli.bench.stream import sse_json
from kairos.cli.up import Child, UpOptions, free_port, nats_server_binary, plan, wait_listening
from kairos.contracts import permissions as P
from kairos.core.engine_model.text import emulated_completion
from kairos.contracts.wire import SamplingParams
from tests.integration.conftest import wait_until

pytestmark = pytest.mark.faults

#: a permission violation in nats-server's log ("... - Publish Violation - Subject \"x\"", nats-server
#: 2.15 ``client.go``; "Permissions Violation" is what the client is told, never logged as such)
VIOLATION = re.compile(r"\b(Publish|Subscription|Permissions) Violation\b")

REPO = Path(__file__).resolve().parents[2]

#: settings every fault test runs with (env of every service; docs/services.md)
FAULT_ENV = {
    "KAIROS_ROUTE_STALL_S": "1.5",  # the ingress sends a request again after a dead/stalled dispatcher
    "KAIROS_LIVENESS_TIMEOUT_S": "2.0",
    "KAIROS_OUTAGE_GRACE_S": "2.0",
    "KAIROS_BUS_OUTAGE_TIMEOUT_S": "8.0",
    "KAIROS_IDLE_TIMEOUT_S": "30",
    "KAIROS_LOG_FORMAT": "json",
    "KAIROS_LOG_LEVEL": "debug",  # the agents' job_accepted lines (debug: one info line per request) are the truth
}


_PROMPTS = iter(range(10, 10 ** 9))


def make_prompt(prompt_len: int) -> list[int]:
    """A token-id prompt no other request of the run has (so every request's output differs)."""
    return [1] * (prompt_len - 1) + [next(_PROMPTS)]


def expected_text(prompt: list[int], max_tokens: int) -> str:
    """The emulated engine's complete output for ``prompt`` and ``max_tokens`` (default sampling;
    the same function the node agents use, kairos/core/engine_model/text.py)."""
    return emulated_completion(SamplingParams(), max_tokens, None, prompt).full_text()


def poll(pred: Callable[[], Any], timeout: float, what: str, every: float = 0.05) -> Any:
    """Call ``pred`` until truthy; AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


async def apoll(pred: Callable[[], Any], timeout: float, what: str, every: float = 0.05) -> Any:
    """:func:`poll` for async tests (the integration tier's ``wait_until``, polling every 50 ms)."""
    return await wait_until(pred, timeout, what, every)


def get_json(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read())
        except ValueError:
            return e.code, None
    except (OSError, ValueError):
        return 0, None


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@dataclass
class Cluster:
    """One Kairos deployment of separate processes; every process it starts is killed at the end."""

    tmp: Path
    prefill: int = 1
    decode: int = 2
    env: dict[str, str] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    children: dict[str, Child] = field(default_factory=dict)
    nats_port: int = 0
    port: int = 0
    started: list[subprocess.Popen] = field(default_factory=list)
    nats_host: str = "127.0.0.1"  #: the address nats-server listens on (0.0.0.0: a network namespace's agent too)

    def __post_init__(self) -> None:
        self.nats_port, self.port = free_port(), free_port()
        self.store = self.tmp / "jetstream"
        self.logs = self.tmp / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        opts = UpOptions(port=self.port, prefill=self.prefill, decode=self.decode, dispatchers=2,
                         log_dir=str(self.logs))
        auth = P.GeneratedAuth.for_nodes(self.agents)
        self.passwords = auth.passwords
        creds = P.write_secrets(auth, self.tmp / "nats-credentials")
        self.nats_conf = self.tmp / "nats-credentials" / "nats-server.conf"
        self.nats_conf.write_text(auth.server_config())
        self.children = {c.name: c for c in plan(opts, self.nats_url, self.logs, creds)}

    @property
    def nats_url(self) -> str:
        return f"nats://127.0.0.1:{self.nats_port}"

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def agents(self) -> list[str]:
        return [f"prefill-{i}" for i in range(self.prefill)] + [f"decode-{i}" for i in range(self.decode)]

    # -- processes --------------------------------------------------------------------------------
    def start_nats(self) -> None:
        logf = open(self.logs / "nats-server.log", "ab")
        p = subprocess.Popen([nats_server_binary(), "-js", "-a", self.nats_host, "-p", str(self.nats_port),
                              "-sd", str(self.store), "-c", str(self.nats_conf)], stdout=logf,
                             stderr=subprocess.STDOUT, start_new_session=True)
        logf.close()
        self.procs["nats-server"] = p
        self.started.append(p)
        assert wait_listening(p, self.nats_port), f"nats-server not listening (exit code {p.poll()})"

    def start(self, name: str, as_name: str | None = None, prefix: tuple[str, ...] = (), **env: str) -> subprocess.Popen:
        """Start service ``name`` (a child of kairos up's plan: ``state_aggregator``, ``prefill-0``,
        ``dispatcher-1``, ``ingress``…) with extra ``KAIROS_*`` env; logs to ``<logs>/<as_name>.log``.
        ``prefix``: a command it runs under (``ip netns exec NS``: another host)."""
        c = self.children[name]
        as_name = as_name or name
        logf = open(self.logs / f"{as_name}.log", "ab")
        p = subprocess.Popen([*prefix, *c.argv], env={**c.env, **FAULT_ENV, **self.env, **env}, stdout=logf,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, cwd=str(REPO))
        logf.close()
        self.procs[as_name] = p
        self.started.append(p)
        return p

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to service ``name`` and wait for it to exit (it is then no longer in ``procs``)."""
        p = self.procs.pop(name)
        os.kill(p.pid, sig)
        p.wait(15)

    def pause(self, name: str) -> None:
        os.kill(self.procs[name].pid, signal.SIGSTOP)

    def resume(self, name: str) -> None:
        os.kill(self.procs[name].pid, signal.SIGCONT)

    def restart_nats(self, down_s: float = 0.0) -> float:
        """SIGKILL nats-server, stay down ``down_s``, start it on the same port and store; returns
        ``time.monotonic()`` when it listens again."""
        self.kill("nats-server")
        if down_s:
            time.sleep(down_s)  # the outage itself is what is under test, not a synchronisation
        self.start_nats()
        return time.monotonic()

    def stop_all(self) -> None:
        for p in self.started:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for p in self.started:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass

    def up(self, dispatchers: int = 1) -> None:
        """NATS, aggregator, agents, ``dispatchers`` dispatcher(s) and the ingress; returns once the
        ingress sees every node as routable (and /health is 200 if a dispatcher runs)."""
        self.start_nats()
        self.start("state_aggregator")
        for a in self.agents:
            self.start(a)
        for i in range(dispatchers):
            self.start(f"dispatcher-{i}")
        self.start("ingress")
        self.wait_routable(need_dispatcher=dispatchers > 0)

    def wait_routable(self, need_dispatcher: bool = True, timeout: float = 60) -> None:
        want = set(self.agents)

        def ok() -> bool:
            for name, p in self.procs.items():
                assert p.poll() is None or name.startswith("dispatcher"), f"{name} exited: {self.tail(name)}"
            status, body = get_json(self.base + "/health")
            if body is None or "routable" not in body:
                return False
            if set(body["routable"]["prefill"]) | set(body["routable"]["decode"]) < want:
                return False
            return status == 200 if need_dispatcher else True
        poll(ok, timeout, "the ingress to see every node routable", every=0.1)

    async def connect(self, user: str):
        """A nats-py client logged in as role ``user`` (``aggregator``, ``agent-decode-0``, …)."""
        import nats
        return await nats.connect(self.nats_url, user=user, password=self.passwords[user],
                                  inbox_prefix=P.inbox_prefix(user), max_reconnect_attempts=0)

    def permission_violations(self) -> list[str]:
        """Permission-violation lines of the nats-server log (must stay empty): nats-server 2.15
        logs ``Publish Violation`` and ``Subscription Violation`` (the old search for
        "Permissions Violation" matched none of them; tests/faults/test_violation_check.py)."""
        try:
            text = (self.logs / "nats-server.log").read_text(errors="replace")
        except OSError:
            return []
        return [line for line in text.splitlines() if VIOLATION.search(line)]

    def tail(self, name: str, n: int = 20) -> str:
        try:
            return "\n".join((self.logs / f"{name}.log").read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def log_events(self, event: str) -> list[dict]:
        """Every JSON log line with ``event`` from every service log."""
        out = []
        for path in self.logs.glob("*.log"):
            for line in path.read_text(errors="replace").splitlines():
                if f'"{event}"' not in line:
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if rec.get("event") == event:
                    rec["_log"] = path.stem
                    out.append(rec)
        return out

    def executions(self) -> Counter:
        """Jobs accepted per bus request id, across every node agent's log."""
        return Counter(r["request_id"] for r in self.log_events("job_accepted"))

    def metric(self, name: str, labels: str = "") -> float:
        """A counter summed over the services' /metrics endpoints that expose it."""
        total = 0.0
        for c in self.children.values():
            url = c.endpoint if c.endpoint.endswith("/metrics") else c.endpoint + "/metrics"
            try:
                with urllib.request.urlopen(url, timeout=1) as r:
                    text = r.read().decode()
            except OSError:
                continue
            for line in text.splitlines():
                if line.startswith(name + (labels if labels else "")) and not line.startswith("#"):
                    head, _, val = line.rpartition(" ")
                    if labels or head == name or head.startswith(name + "{"):
                        total += float(val)
        return total


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.stop_all()
        shutil.rmtree(c.store, ignore_errors=True)


# -- clients ----------------------------------------------------------------------------------------

@dataclass
class Outcome:
    """What one client saw."""

    status: int  #: HTTP status; 0 = no answer before the client deadline (hung) or connection error
    text: str = ""
    tokens: int = 0  #: completion tokens (usage) or SSE chunks with text
    error: dict | None = None  #: OpenAI error body (status >= 400, or an SSE error event)
    stream: bool = False
    max_tokens: int = 0
    elapsed_s: float = 0.0
    prompt: list[int] = field(default_factory=list)
    hung: bool = False
    rid: str | None = None
    ended_at: float = 0.0  #: time.monotonic() when the answer was complete
    started_at: float = 0.0  #: time.monotonic() when the request was sent
    ttft_s: float | None = None  #: a stream's first token chunk, s after the request was sent

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def explicit_error(self) -> bool:
        return self.error is not None and isinstance(self.error.get("code"), str)


async def request(http: aiohttp.ClientSession, base: str, max_tokens: int, stream: bool, prompt_len: int = 200,
                  deadline_s: float = 45.0) -> Outcome:
    """One completion; never raises. A stream's text is the concatenation of its chunks."""
    prompt = make_prompt(prompt_len)
    body = {"model": "kairos-emulated", "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    t0 = time.monotonic()
    out = Outcome(status=0, stream=stream, max_tokens=max_tokens, prompt=prompt, started_at=t0)
    try:
        async with asyncio.timeout(deadline_s):
            async with http.post(base + "/v1/completions", json=body) as r:
                out.status = r.status
                out.rid = r.headers.get("X-Request-Id")
                if stream and r.status == 200 and r.content_type == "text/event-stream":
                    parts = []
                    async for ev in sse_json(r.content.iter_any()):
                        if "error" in ev:
                            out.error = ev["error"]
                            continue
                        for ch in ev.get("choices", []):  # one chunk per token, the last with the finish reason
                            if out.ttft_s is None:
                                out.ttft_s = time.monotonic() - t0
                            parts.append(ch.get("text") or "")
                            out.tokens += 1
                    out.text = "".join(parts)
                else:
                    data = await r.json(content_type=None)
                    if r.status == 200:
                        out.text = data["choices"][0]["text"]
                        out.tokens = data["usage"]["completion_tokens"]
                        out.rid = data["id"]
                    else:
                        out.error = data.get("error")
    except TimeoutError:
        out.hung = True
    except (aiohttp.ClientError, ValueError) as exc:
        out.error = {"client_error": repr(exc)}
    out.ended_at = time.monotonic()
    out.elapsed_s = out.ended_at - t0
    return out


def check(outcomes: list[Outcome], cluster: Cluster, allow_errors: bool = True) -> dict:
    """The counts every fault test asserts; returns them (for the report)."""
    sent = len(outcomes)
    completed = [o for o in outcomes if o.ok]
    errors = [o for o in outcomes if not o.ok and o.explicit_error]
    hung = [o for o in outcomes if o.hung]
    other = [o for o in outcomes if o not in completed and o not in errors and o not in hung]
    mixed = [o for o in completed if o.text != expected_text(o.prompt, o.max_tokens) or o.tokens != o.max_tokens]
    # a stream cut by an explicit error may carry a prefix of the output, never more, never mixed
    bad_prefix = [o for o in errors if o.text and not expected_text(o.prompt, o.max_tokens).startswith(o.text)]
    dup = {rid: n for rid, n in cluster.executions().items() if n > 1}
    violations = cluster.permission_violations()
    assert not violations, violations[:5]
    counts = {"sent": sent, "completed": len(completed), "errors": len(errors), "hung": len(hung),
              "other": len(other), "mixed": len(mixed) + len(bad_prefix), "duplicate_executions": len(dup)}
    assert not hung, f"{len(hung)} request(s) hung: {counts}"
    assert not other, f"answers that are neither a completion nor an explicit error: {other[:3]}"
    assert sent == len(completed) + len(errors), counts
    assert not mixed and not bad_prefix, f"responses with wrong tokens: {(mixed + bad_prefix)[:3]}"
    assert not dup, f"requests executed more than once: {dup}"
    if not allow_errors:
        assert not errors, f"unexpected errors: {[o.error for o in errors][:5]}"
    return counts
