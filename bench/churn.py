"""Node churn under load: what a client sees when a node stops or dies (issue 33).

    python bench/churn.py [--cases LIST] [--rate 10] [--duration 30] [--fault-at 12] [--json PATH]
                          [--repo DIR]

For each case, a fresh ``kairos up`` (2 prefill + 2 decode emulated nodes, 2 dispatchers) takes an
open-loop streaming load (``--rate`` requests per second for ``--duration`` s; prompts of 64–512
tokens, outputs of 100–300, seeded) and, ``--fault-at`` s in, one fault on its nodes, by pid (from
the ``services.json`` ``kairos up`` keeps):

==================  =====================================================================
``decode-sigterm``  SIGTERM to a decode agent (a graceful stop, as Kubernetes sends): it drains
``decode-sigkill``  SIGKILL of a decode agent
``prefill-sigkill`` SIGKILL of a prefill agent
``prefill-sigterm`` SIGTERM to a prefill agent (the prefill cases send prompts of 2,000–7,000 tokens at
                    half the rate: the node holds requests when the fault comes)
``decode-sigstop``  a decode agent paused 5 s (SIGSTOP, then SIGCONT)
``rolling-restart`` SIGTERM to each of the four agents in turn, each back (``kairos up`` restarts
                    it) and routable again before the next
==================  =====================================================================

Every response's text is compared with the emulated engine's own output for its prompt
(:func:`kairos.core.engine_model.text.emulated_completion`, the function the nodes use), so a token
lost, repeated or taken from another execution is a wrong text. Per case it prints: sent,
completed, failed (an explicit error before the first token), cut (an error after it), wrong text,
duplicated tokens (more tokens than asked), re-submitted (sent again before any token reached the
client), migrated (continued on another node after tokens had: their record lists the attempts), the largest inter-token gap of a migrated request and of the others
(ms), and the ingress's ``forged`` out events (``kairos_ingress_forged_messages_total{kind=out_event}``:
an event of a node the request's job did not name) and ``late`` ones (events of an attempt given up,
dropped: ``old_attempt``). Each row is one JSON line with ``--json`` (``python -m tools.docgen record
churn --rows-from PATH -- ...`` keeps them in ``bench/results/churn.jsonl`` for the README).

``--repo DIR`` runs the stack from another checkout of Kairos (``bench/churn_before.sh``: the commit
before issue 33, for the README's "before" column); the harness and its truth stay this one's.

The faults tier runs the same cases, shorter, and asserts 0 failed, 0 cut, 0 wrong
(``tests/faults/test_node_churn.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kairos.cli.bench.stream import sse_json  # noqa: E402
from kairos.cli.processes import free_port  # noqa: E402
from kairos.contracts.wire import SamplingParams  # noqa: E402
from kairos.core.engine_model.text import emulated_completion  # noqa: E402

CASES = ("decode-sigterm", "decode-sigkill", "prefill-sigkill", "prefill-sigterm", "decode-sigstop", "rolling-restart")
#: the prefill cases send long prompts (2,000–7,000 tokens) at half the rate, so that the prefill node
#: holds requests when the fault comes (short prompts are prefilled in milliseconds)
LONG_PROMPTS = {"prefill-sigkill", "prefill-sigterm"}
PAUSE_S = 5.0  #: decode-sigstop: how long the agent is stopped
MODEL = "kairos-emulated"


@dataclass
class Outcome:
    """One request as its client saw it."""

    prompt: list[int]
    max_tokens: int
    started: float
    status: int = 0
    rid: str | None = None
    text: str = ""
    tokens: int = 0
    error: str | None = None  #: the error code (an HTTP error body's or an SSE error event's)
    gaps_ms: list[float] = field(default_factory=list)  #: between consecutive token chunks
    hung: bool = False

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and not self.hung

    @property
    def cut(self) -> bool:
        return self.status == 200 and (self.error is not None or self.hung)

    def expected(self) -> str:
        return emulated_completion(SamplingParams(), self.max_tokens, None, self.prompt).full_text()


async def one_request(http: aiohttp.ClientSession, base: str, prompt: list[int], max_tokens: int,
                      timeout_s: float) -> Outcome:
    """A streaming completion; never raises."""
    out = Outcome(prompt=prompt, max_tokens=max_tokens, started=time.monotonic())
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    last = None
    try:
        async with asyncio.timeout(timeout_s):
            async with http.post(base + "/v1/completions", json=body) as r:
                out.status, out.rid = r.status, r.headers.get("X-Kairos-Request-Id")
                if r.status != 200:
                    out.error = ((await r.json(content_type=None)) or {}).get("error", {}).get("code", str(r.status))
                    return out
                parts = []
                async for ev in sse_json(r.content.iter_any()):
                    if "error" in ev:
                        out.error = ev["error"].get("code") or "error"
                        continue
                    for ch in ev.get("choices", []):
                        now = time.monotonic()
                        if last is not None:
                            out.gaps_ms.append((now - last) * 1000.0)
                        last = now
                        parts.append(ch.get("text") or "")
                        out.tokens += 1
                out.text = "".join(parts)
    except TimeoutError:
        out.hung = True
    except (aiohttp.ClientError, ValueError) as exc:
        out.error = f"client_error:{type(exc).__name__}"
    return out


class Stack:
    """One ``kairos up`` 2P2D with 2 dispatchers, its services file and its ingress."""

    def __init__(self, workdir: Path, env: dict[str, str], repo: Path = ROOT) -> None:
        self.port, self.logs, self.out = free_port(), workdir / "logs", workdir / "up.out"
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kairos", "up", "--port", str(self.port), "--log-dir", str(self.logs),
             "--prefill", "2", "--decode", "2", "--dispatchers", "2"],
            cwd=str(repo), env={**os.environ, **env}, stdout=open(workdir / "up.out", "ab"),
            stderr=subprocess.STDOUT, start_new_session=True)
        self.wait(lambda: self.proc.poll() is not None or self.routable() >= set(self.nodes()), 120, "the stack up")
        if self.proc.poll() is not None:
            raise RuntimeError(f"kairos up exited: {(workdir / 'up.out').read_text()[-2000:]}")

    @staticmethod
    def nodes() -> list[str]:
        return ["prefill-0", "prefill-1", "decode-0", "decode-1"]

    def health(self) -> dict:
        try:
            with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            return json.loads(e.read() or b"{}")
        except (OSError, ValueError):
            return {}

    def routable(self) -> set[str]:
        r = self.health().get("routable") or {}
        return set(r.get("prefill", [])) | set(r.get("decode", []))

    def pid(self, service: str) -> int:
        """The service's current pid: from ``services.json``, or, for a ``kairos up`` that keeps none (one
        from before issue 33, which restarted no agent: the ``before`` rows), from its banner."""
        path = self.logs / "services.json"
        if path.exists():
            return next(r["pid"] for r in json.loads(path.read_text()) if r["name"] == service)
        for line in self.out.read_text().splitlines():
            words = line.split()
            if words and words[0] == service:
                return next(int(w) for w in words[1:] if w.isdigit())
        raise RuntimeError(f"no pid of {service} in {self.out}")

    @staticmethod
    def wait(pred, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not pred():
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout_s} s waiting for {what}")
            time.sleep(0.1)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        with urllib.request.urlopen(self.base + "/metrics", timeout=5) as r:
            text = r.read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def record(self, rid: str) -> dict | None:
        try:
            with urllib.request.urlopen(f"{self.base}/v1/requests/{rid}", timeout=5) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def restart_and_wait(st: Stack, node: str, sig: int) -> None:
    """Send ``sig`` to ``node``'s agent; wait until ``kairos up`` restarted it and it is routable again."""
    old = st.pid(node)
    os.kill(old, sig)
    st.wait(lambda: st.pid(node) != old, 120, f"{node} restarted")
    st.wait(lambda: node in st.routable(), 60, f"{node} routable again")


def fault(st: Stack, case: str) -> None:
    """Inject ``case`` (module docstring); returns when it is over (blocking: run it in a thread)."""
    if case == "decode-sigterm":
        os.kill(st.pid("decode-1"), signal.SIGTERM)
    elif case == "prefill-sigterm":
        os.kill(st.pid("prefill-1"), signal.SIGTERM)
    elif case == "decode-sigkill":
        os.kill(st.pid("decode-1"), signal.SIGKILL)
    elif case == "prefill-sigkill":
        os.kill(st.pid("prefill-1"), signal.SIGKILL)
    elif case == "decode-sigstop":
        pid = st.pid("decode-1")
        os.kill(pid, signal.SIGSTOP)
        time.sleep(PAUSE_S)  # the pause is the fault
        os.kill(pid, signal.SIGCONT)
    elif case == "rolling-restart":
        for node in st.nodes():
            restart_and_wait(st, node, signal.SIGTERM)
    else:
        raise ValueError(f"unknown case {case!r}: one of {', '.join(CASES)}")


async def run_case(case: str, rate: float, duration_s: float, fault_at_s: float, seed: int = 1,
                   env: dict[str, str] | None = None, timeout_s: float = 120.0, logs: Path | None = None,
                   repo: Path = ROOT) -> dict:
    """One case on a fresh stack; the row (module docstring). The load goes on until the fault is
    over and ``duration_s`` has passed. ``logs``: keep the stack's logs in ``logs/<case>``; ``repo``:
    the checkout whose ``kairos up`` runs (``python -m kairos`` with it as the working directory)."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix=f"kairos-churn-{case}-") as tmp:
        work = Path(tmp) if logs is None else logs / case
        work.mkdir(parents=True, exist_ok=True)
        st = await asyncio.to_thread(Stack, work, env or {}, repo)
        try:
            before = st.metrics()
            tasks: list[asyncio.Task] = []
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
                t0 = time.monotonic()
                fault_task: asyncio.Future | None = None
                n = 0
                while time.monotonic() - t0 < duration_s or (fault_task is not None and not fault_task.done()):
                    if fault_task is None and time.monotonic() - t0 >= fault_at_s:
                        fault_task = asyncio.ensure_future(asyncio.to_thread(fault, st, case))
                    n += 1
                    lo, hi = (1999, 6999) if case in LONG_PROMPTS else (63, 511)
                    prompt = [rng.randrange(3, 32000) for _ in range(rng.randint(lo, hi))] + [n]
                    tasks.append(asyncio.create_task(one_request(http, st.base, prompt, rng.randint(100, 300),
                                                                 timeout_s)))
                    await asyncio.sleep(rng.expovariate(rate / 2 if case in LONG_PROMPTS else rate))
                outcomes = await asyncio.gather(*tasks)
                load_s = time.monotonic() - t0
                if fault_task is not None:
                    await fault_task
            after = st.metrics()
            records = [await asyncio.to_thread(st.record, o.rid) if o.rid else None for o in outcomes]
        finally:
            await asyncio.to_thread(st.stop)
    return summarize(case, outcomes, records, before, after, rate, load_s)


def _delta(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def summarize(case: str, outcomes: list[Outcome], records: list[dict | None], before: dict, after: dict,
              rate: float, load_s: float) -> dict:
    """The row of one case from the clients' outcomes, the requests' records and the ingress's metrics."""
    def moved(rec: dict | None, mark: str) -> bool:
        return bool(rec) and any(mark in a["attempt_id"] for a in rec.get("attempts") or [])
    migrated = [o for o, rec in zip(outcomes, records) if moved(rec, "-m")]  # continued after tokens were sent
    others = [o for o in outcomes if o not in migrated]
    gap = lambda os_: round(max((g for o in os_ for g in o.gaps_ms), default=0.0), 1)  # noqa: E731
    return {
        "case": case, "rate_rps": rate / 2 if case in LONG_PROMPTS else rate, "load_s": round(load_s, 1), "sent": len(outcomes),
        "completed": sum(o.ok for o in outcomes),
        "failed": sum(not o.ok and not o.cut for o in outcomes), "cut": sum(o.cut for o in outcomes),
        "wrong_text": sum(o.ok and o.text != o.expected() for o in outcomes),
        "duplicated_tokens": sum(o.tokens > o.max_tokens for o in outcomes),
        "resubmitted": sum(moved(rec, "-r") for rec in records),  # sent again before any token reached its client
        "migrated": len(migrated),
        "max_gap_migrated_ms": gap(migrated), "max_gap_others_ms": gap(others),
        "forged": _delta(before, after, "kairos_ingress_forged_messages_total", kind="out_event"),
        "late_events": _delta(before, after, "kairos_ingress_dropped_events_total", reason="old_attempt"),
        "errors": sorted({o.error or ("hung" if o.hung else "") for o in outcomes if not o.ok}),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Node churn under a streaming load: completed / failed / cut / "
                                             "wrong text per fault (issue 33).")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--rate", type=float, default=10.0, help="requests per second (default 10)")
    ap.add_argument("--duration", type=float, default=30.0, help="load, s (default 30; longer while a fault lasts)")
    ap.add_argument("--fault-at", type=float, default=12.0, help="the fault, s into the load (default 12)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path, help="write the rows here, one JSON object per line")
    ap.add_argument("--logs", type=Path, help="keep each case's service logs in LOGS/<case> (default: removed)")
    ap.add_argument("--repo", type=Path, default=ROOT,
                    help="run the stack from this checkout of Kairos (default: this one)")
    args = ap.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad or not cases:
        ap.error(f"unknown case(s) {bad}: choose from {', '.join(CASES)}")
    if not (args.rate > 0 and args.duration > 0 and 0 <= args.fault_at < args.duration):
        ap.error("--rate and --duration must be > 0 and 0 <= --fault-at < --duration")
    if not (args.repo / "kairos" / "__main__.py").is_file():
        ap.error(f"--repo {args.repo}: not a checkout of Kairos (no kairos/__main__.py)")
    rows = []
    for case in cases:
        row = asyncio.run(run_case(case, args.rate, args.duration, args.fault_at, args.seed, logs=args.logs,
                                   repo=args.repo.resolve()))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0 if all(r["failed"] == r["cut"] == r["wrong_text"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
