"""``kairos bench`` stopped by Ctrl-C (SIGINT) or SIGTERM (kairos/cli/bench/interrupt.py, ``run_bench``'s
``interrupt``): it stops sending, cancels the requests in flight (their connections close, so the
server cancels them), prints the result block of what finished marked INTERRUPTED, writes --json with
``interrupted`` set, and exits 130 (SIGINT) or 143 (SIGTERM). A new user's trial lost everything:
``kill -INT`` printed only ``Aborted!`` and wrote no JSON, ``kill -TERM`` printed nothing.

The server signals the bench when the held request arrives (one request in flight at a time under
``--max-concurrency 1``, so the three before it have finished): synchronisation by the request
itself, no sleep. SIGINT goes to this process (the bench runs in it, on the main thread); SIGTERM to
a ``kairos bench`` subprocess, since SIGTERM's default would end the test run itself."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from aiohttp import web
from click.testing import CliRunner

from kairos.cli.bench import BenchConfig, run_bench
from kairos.cli.bench.interrupt import Interrupt, exit_status
from kairos.cli.main import main
from kairos.core.workload.workloads import WorkloadRequest
from tests.unit.fake_openai import FakeOpenAI, serve, write_csv

PL_HOLD = 33  #: streams one token, signals the bench, then holds the stream open until the client leaves
N_BEFORE, N_AFTER = 3, 6  #: requests that finish before the held one; requests never sent after it


class HoldingFake(FakeOpenAI):
    """The fake OpenAI server; the request of prompt length :data:`PL_HOLD` sends ``signum`` to ``pid``
    after its first token and notes when its handler is cancelled (the client closed the connection)."""

    def __init__(self, signum: int) -> None:
        super().__init__()
        self.signum = signum
        self.pid_known = threading.Event()
        self.pid = os.getpid()
        self.cancelled_on_server = threading.Event()
        self.interrupt: Interrupt | None = None  #: if set, requested from this thread instead of a signal

    async def _respond(self, r: web.Request, body: dict, leave) -> web.StreamResponse:
        if len(body["prompt"]) != PL_HOLD:
            return await super()._respond(r, body, leave)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(r)
        chunk = {"id": "cmpl-held", "choices": [{"index": 0, "text": "t0 ", "finish_reason": None}]}
        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await asyncio.get_running_loop().run_in_executor(None, self.pid_known.wait)
        if self.interrupt is not None:
            self.interrupt.request(self.signum)
        else:
            os.kill(self.pid, self.signum)
        try:
            await asyncio.Event().wait()  # held until the client goes away
        except asyncio.CancelledError:
            self.cancelled_on_server.set()
            raise
        return resp


def _workload(tmp_path: Path) -> Path:
    rows = [(0.0, 10 + k, 3) for k in range(N_BEFORE)] + [(0.0, PL_HOLD, 50)] + \
           [(0.0, 20 + k, 3) for k in range(N_AFTER)]
    return write_csv(tmp_path / "wl.csv", rows)


def _args(url: str, csv: Path, out: Path) -> list[str]:
    return ["bench", "--url", url, "--no-progress", "--workload", f"trace:{csv}", "--max-concurrency", "1",
            "--request-timeout", "60", "--json", str(out)]


def _check_interrupted(out: Path, stdout: str, stderr: str, name: str) -> None:
    rep = json.loads(out.read_text())
    n = N_BEFORE + 1 + N_AFTER
    assert rep["interrupted"]["signal"] == name
    assert (rep["interrupted"]["sent"], rep["interrupted"]["requests"], rep["interrupted"]["cancelled_in_flight"]) \
        == (N_BEFORE + 1, n, 1)
    assert (rep["sent"], rep["completed"], rep["failed"]) == (N_BEFORE + 1, N_BEFORE, 0)  # the held one: no failure
    assert exit_status(rep) == 128 + signal.Signals[name].value
    assert re.search(rf"^INTERRUPTED \({name}\) after [\d.,]+ s: {N_BEFORE + 1} of {n} requests were sent", stdout, re.M)
    assert re.search(rf"^Successful requests:\s+{N_BEFORE}$", stdout, re.M)  # vLLM's block, of what finished
    assert f"sent {N_BEFORE + 1}, completed {N_BEFORE}, failed 0, cancelled 1 in flight ({name})" in stderr


def test_sigint_reports_what_finished_cancels_the_rest_and_exits_130(tmp_path, monkeypatch):
    # an interactive shell's Ctrl-C: Python's own SIGINT handler (a background job would ignore SIGINT)
    monkeypatch.setattr(signal, "_kb_saved", signal.signal(signal.SIGINT, signal.default_int_handler), raising=False)
    try:
        fake = HoldingFake(signal.SIGINT)
        fake.pid_known.set()
        out = tmp_path / "b.json"
        with serve(fake, handler_cancellation=True) as url:
            res = CliRunner().invoke(main, _args(url, _workload(tmp_path), out))
            assert fake.cancelled_on_server.wait(10), "the held request was not cancelled on the server"
        assert res.exit_code == 130, res.output
        assert len(fake.bodies) == N_BEFORE + 1  # nothing sent after the interruption
        _check_interrupted(out, res.stdout, res.stderr, "SIGINT")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is given back
    finally:
        signal.signal(signal.SIGINT, signal._kb_saved)


def test_sigterm_reports_what_finished_and_exits_143(tmp_path):
    fake = HoldingFake(signal.SIGTERM)
    out = tmp_path / "b.json"
    repo = Path(__file__).resolve().parents[2]
    with serve(fake, handler_cancellation=True) as url:
        proc = subprocess.Popen([sys.executable, "-m", "kairos", *_args(url, _workload(tmp_path), out)], cwd=repo,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(repo)})
        fake.pid = proc.pid
        fake.pid_known.set()
        try:
            stdout, stderr = proc.communicate(timeout=120)
        finally:
            proc.kill()
        assert fake.cancelled_on_server.wait(10), "the held request was not cancelled on the server"
    assert proc.returncode == 143, stdout + stderr
    assert len(fake.bodies) == N_BEFORE + 1
    _check_interrupted(out, stdout, stderr, "SIGTERM")


async def test_open_loop_stops_waiting_for_the_next_arrival_and_cancels_the_requests_in_flight():
    """``--rps``: the interruption comes while the replay waits for the next arrival (1000 s away)
    with requests streaming; neither the wait nor the streams are waited for."""
    fake = HoldingFake(signal.SIGINT)
    fake.interrupt = Interrupt()
    fake.pid_known.set()
    reqs = [WorkloadRequest("a", 0.0, 10, 3), WorkloadRequest("long", 0.0, 11, 2_000), WorkloadRequest("held", 0.0,
            PL_HOLD, 50), WorkloadRequest("later", 1000.0, 12, 3)]
    with serve(fake, handler_cancellation=True) as url:
        res = await asyncio.wait_for(run_bench(BenchConfig(url=url, progress=False), reqs, fake.interrupt), 60)
        assert fake.cancelled_on_server.wait(10)
    assert res.interrupted == "SIGINT" and res.requests == 4 and res.sent == 3
    assert res.cancelled >= 1 and len(res.outcomes) == 3 - res.cancelled  # "a", "long" may have finished first
    assert all(not o.cancelled and o.error is None for o in res.outcomes)  # cancelling fails no request
    assert len(fake.bodies) == 3  # "later" never sent


def test_a_second_signal_aborts_at_once():
    it = Interrupt()
    it.request(signal.SIGTERM)
    assert it.name == "SIGTERM"
    with pytest.raises(KeyboardInterrupt):
        it.request(signal.SIGINT)
    it = Interrupt()
    it.request(signal.SIGTERM)
    with pytest.raises(SystemExit) as exc:
        it.request(signal.SIGTERM)
    assert exc.value.code == 143
