"""The HTTP side of ``kairos bench``: probe the ingress, replay a workload open-loop, collect deflections.

Inputs: :class:`BenchConfig` (URL, model, concurrency bound, timeouts in s, API key) and the
workload (:class:`~kairos.core.workload.workloads.WorkloadRequest` with arrival offsets in s).
Outputs: a :class:`BenchResult`: one :class:`Outcome` per request (send time, what its stream
delivered, its error, the server's request id) and one
:class:`~kairos.core.workload.serving_metrics.RequestRecord` each, the run's duration and send
span (s), and the deflection count from ``GET /v1/requests/{id}`` or, failing that, from the
``/metrics`` counters (:func:`deflect_delta`). Request failures are data, never raised; only usage
errors raise :class:`BenchError`. The rules followed are in :mod:`kairos.cli.bench`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kairos.cli.bench.interrupt import Interrupt
from kairos.cli.bench.progress import DEFAULT_PROGRESS_INTERVAL_S, ProgressReporter
from kairos.cli.bench.stream import (SSEParser, StreamState, error_code, error_message, int_or_none, make_record,
                                     request_body)
from kairos.core.workload.serving_metrics import RequestRecord
from kairos.core.workload.workloads import WorkloadRequest

log = logging.getLogger(__name__)

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_REQUEST_TIMEOUT_S = 300.0
LOOKUP_CONCURRENCY = 16  #: parallel GET /v1/requests/{id} after the run
LOOKUP_TIMEOUT_S = 10.0  #: per lookup / metrics scrape / model probe, seconds
PROGRESS_TICK_S = 1.0  #: period of the progress reporter's tick (bar refresh; a line every interval), seconds
#: Prometheus sample names whose ``decision="deflect"`` series count deflections (summed)
DEFLECT_COUNTERS: tuple[str, ...] = ("kairos_decisions_total", "kairos_dispatcher_decisions_total")


class BenchError(Exception):
    """A usage error: bad URL or option, server unreachable at start, bad workload. The CLI exits 2."""


def check_url(url: str) -> str:
    """The base URL without a trailing slash and without a trailing ``/v1`` path segment.

    Requests go to ``{base}/v1/completions`` and ``{base}/v1/models`` (as ``vllm bench serve``'s
    ``--base-url`` plus its ``--endpoint /v1/completions``), but an OpenAI client's base URL ends in
    ``/v1``: given one, the bench would ask ``/v1/v1/…`` and get 404 on every request, so a path
    ending in ``/v1`` or ``/v1/`` is dropped (:func:`v1_note` says so). Another path (a proxy
    prefix) is kept.

    Raises:
        BenchError: not an ``http(s)://host[:port]`` URL.
    """
    from yarl import URL

    try:
        u = URL(url.strip())
    except (ValueError, TypeError) as exc:
        raise BenchError(f"bad --url {url!r}: {exc}") from None
    if u.scheme not in ("http", "https") or not u.host:
        raise BenchError(f"bad --url {url!r}: expected http://HOST[:PORT] or https://HOST[:PORT]")
    return str(_without_v1(u) or u).rstrip("/")


def _without_v1(u: Any) -> Any:
    """The ``yarl.URL`` ``u`` with the trailing ``/v1`` segment of its path dropped; None when its
    path does not end in one (a host named ``v1`` is not a path)."""
    path = u.path.rstrip("/")
    return u.with_path(path[:-len("/v1")] or "/") if path.endswith("/v1") else None


def v1_note(given: str, base: str) -> str | None:
    """The one-line note ``kairos bench`` prints when :func:`check_url` dropped a trailing ``/v1``
    from ``given`` (a URL it accepted) to make ``base`` (None when it did not)."""
    from yarl import URL

    if _without_v1(URL(given.strip())) is None:
        return None
    return (f"note: --url {given.strip()} ends in /v1; using {base} (the bench adds /v1/completions and "
            f"/v1/models itself)")


def parse_deflect_counter(text: str) -> float | None:
    """Sum of the :data:`DEFLECT_COUNTERS` samples labelled ``decision="deflect"`` in a Prometheus
    text exposition; None if no such counter family is exposed (0.0 if it is, without deflects)."""
    from prometheus_client.parser import text_string_to_metric_families

    found = False
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in DEFLECT_COUNTERS:
                found = True
                if s.labels.get("decision") == "deflect":
                    total += s.value
    return total if found else None


def deflect_delta(before: str | None, after: str | None) -> float | None:
    """Deflections during the run from two ``/metrics`` scrapes (None where unknown)."""
    if before is None or after is None:
        return None
    a = parse_deflect_counter(after)
    if a is None:
        return None
    b = parse_deflect_counter(before)
    return a - (b or 0.0)


@dataclass
class BenchConfig:
    """Options of one run (times in seconds)."""

    url: str = DEFAULT_URL
    model: str | None = None  #: None → the first id of ``GET /v1/models``
    max_concurrency: int | None = None  #: None → unbounded (pure open loop)
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    progress: bool = True  #: progress on stderr: a tqdm bar on a terminal, else periodic lines
    progress_interval_s: float = DEFAULT_PROGRESS_INTERVAL_S  #: seconds between progress lines (not a terminal)
    api_key: str | None = None  #: sent as ``Authorization: Bearer`` (ingress with API keys)
    #: after the replay, read each request's record (``GET /v1/requests/{id}``: decisions, deflection
    #: count); False skips it (``deflections`` is then None): bench/control_plane.py measures the
    #: CPU of serving alone and reads the records itself afterwards
    lookup_records: bool = True
    #: seed of the prompts (:func:`~kairos.cli.bench.stream.prompt_token_ids`): ``kairos bench`` passes
    #: ``--seed``; None → prompts that depend on the request index only (``--reuse-prompts``)
    prompt_seed: int | None = None


@dataclass
class Outcome:
    """One request's raw result."""

    index: int
    req: WorkloadRequest
    sent_s: float  #: seconds since the bench start
    state: StreamState
    error: str | None
    server_id: str | None
    #: seconds since the bench start at which the request was due and began waiting for a
    #: ``max_concurrency`` slot (None: not recorded); sent_s − queued_s is vLLM's client queue time
    queued_s: float | None = None
    #: the failure's group (None: no failure, or one found later by :func:`make_record`): the
    #: server's error ``code`` / ``type`` (an HTTP error body or an ``error`` event), ``HTTP <status>``
    #: for a body without one, the exception class for a client-side failure (``TimeoutError`` for
    #: ``request_timeout_s``), ``incomplete_stream`` for a stream without ``data: [DONE]``
    error_code: str | None = None
    #: in flight when the run was interrupted, and cancelled (:func:`run_bench`'s ``interrupt``)
    cancelled: bool = False


@dataclass
class BenchResult:
    """What one run produced (times in seconds)."""

    records: list[RequestRecord]
    outcomes: list[Outcome]
    model: str
    sent: int
    duration_s: float  #: bench start → last request finished, seconds
    send_span_s: float  #: first → last request actually sent, seconds (achieved rate = (sent − 1) / span)
    deflections: int | None
    deflections_source: str | None  #: "requests" (GET /v1/requests/{id}), "metrics" or None
    requests: int | None = None  #: requests in the workload (None: not recorded)
    #: the signal that stopped the run early (``SIGINT``; :mod:`kairos.cli.bench.interrupt`), None if it ran out
    interrupted: str | None = None
    #: requests in flight when the run was interrupted, cancelled: counted in ``sent``, left out of
    #: ``records`` and ``outcomes`` (neither completed nor failed)
    cancelled: int = 0


async def _get(session, url: str, timeout_s: float = LOOKUP_TIMEOUT_S) -> tuple[int, str]:
    async with asyncio.timeout(timeout_s):
        async with session.get(url) as resp:
            return resp.status, await resp.text()


async def probe(session, url: str, model: str | None) -> tuple[str, int | None]:
    """Check the server is reachable and pick the model: ``(model, max_model_len or None)``.

    Raises:
        BenchError: connection refused/timeout, a 401 (missing or wrong API key), no ``--model``
            and no model listed, or a ``--model`` the server does not list.
    """
    import aiohttp

    try:
        status, text = await _get(session, f"{url}/v1/models")
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise BenchError(f"cannot reach the ingress at {url}: {type(exc).__name__}: {exc}") from None
    if status == 401:
        raise BenchError(f"{url} requires an API key (HTTP 401 from /v1/models): pass --api-key KEY or set "
                         f"OPENAI_API_KEY, or check the key")
    cards: list = []
    if status == 200:
        try:
            cards = [c for c in json.loads(text).get("data", []) if isinstance(c, dict)]
        except (ValueError, AttributeError):
            cards = []
    if model is None:
        if not cards or not isinstance(cards[0].get("id"), str):
            hint = (f"; is {url} the server's base URL (http://HOST:PORT, without /v1)? Else pass --model"
                    if status == 404 else "; pass --model")
            raise BenchError(f"{url}/v1/models gave no model (HTTP {status}){hint}")
        model = cards[0]["id"]
    ids = [c.get("id") for c in cards]
    if cards and model not in ids:
        raise BenchError(f"--model {model!r} is not served by {url} (served: {', '.join(map(str, ids))})")
    card = next((c for c in cards if c.get("id") == model), {})
    return model, int_or_none(card.get("max_model_len"))


async def send_one(session, url: str, index: int, req: WorkloadRequest, model: str, t0: float,
                   timeout_s: float, prompt_seed: int | None = None, state: StreamState | None = None) -> Outcome:
    """Send one streaming request and record its chunk arrivals (never raises).

    Each SSE event is stamped when it is parsed, like ``vllm bench serve``'s client (one
    ``perf_counter()`` per message), so events that came in one read are separate arrivals.
    ``state``: the :class:`StreamState` to fill (the progress reporter reads its chunks while the
    request streams); None: a new one.
    """
    body = request_body(req, index, model, prompt_seed)
    state = StreamState() if state is None else state
    parser = SSEParser()
    error: str | None = None
    code: str | None = None
    header_id: str | None = None
    sent_s = time.perf_counter() - t0
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                header_id = resp.headers.get("x-request-id")
                if resp.status != 200:
                    text = await resp.text()
                    try:
                        err = json.loads(text).get("error") or text
                        msg, code = error_message(err), error_code(err)
                    except (ValueError, AttributeError):
                        msg = text.strip()[:300] or (resp.reason or "")
                    error, code = f"HTTP {resp.status}: {msg}", code or f"HTTP {resp.status}"
                else:
                    async for data in resp.content.iter_any():
                        for ev in parser.feed(data):
                            state.on_data(ev, time.perf_counter() - t0)
                    t = time.perf_counter() - t0
                    for ev in parser.close():
                        state.on_data(ev, t)
                    if state.error is None and not state.done:
                        error, code = "stream ended before data: [DONE]", "incomplete_stream"
    except TimeoutError:
        error, code = f"timeout after {timeout_s:g} s", "TimeoutError"
    except Exception as exc:  # aiohttp.ClientError, OSError, ...: the request failed, the run goes on
        error, code = f"{type(exc).__name__}: {exc}".rstrip(": "), type(exc).__name__
    if state.error is not None:
        error, code = state.error, state.error_code
    return Outcome(index, req, sent_s, state, error, state.server_id or header_id, error_code=code)


async def lookup_decisions(session, url: str, ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``GET /v1/requests/{id}`` for each id: id → the decision record (JSON object) for the records
    found (200). Its ``decision`` is deflect/keep; its ``measured`` object has the server-side
    TTFT components in ms (Kairos ingress; absent elsewhere)."""
    sem = asyncio.Semaphore(LOOKUP_CONCURRENCY)
    found: dict[str, dict[str, Any]] = {}

    async def one(rid: str) -> None:
        async with sem:
            try:
                status, text = await _get(session, f"{url}/v1/requests/{rid}")
                if status == 200:
                    obj = json.loads(text)
                    if isinstance(obj, dict):
                        found[rid] = obj
            except Exception as exc:  # a lookup failure only loses that record
                log.debug("GET /v1/requests/%s failed: %r", rid, exc)

    await asyncio.gather(*(one(r) for r in ids))
    return found


async def scrape_metrics(session, url: str) -> str | None:
    """``GET /metrics`` text, or None if unavailable."""
    try:
        status, text = await _get(session, f"{url}/metrics")
    except Exception:
        return None
    return text if status == 200 else None


async def run_bench(cfg: BenchConfig,
                    workload: Sequence[WorkloadRequest] | Callable[[int | None], Sequence[WorkloadRequest]],
                    interrupt: Interrupt | None = None) -> BenchResult:
    """Probe the server, replay the workload open-loop, then collect deflections.

    Args:
        cfg: options; ``cfg.url`` is checked with :func:`check_url`.
        workload: the requests, or a function of the server's ``max_model_len`` (None if
            ``/v1/models`` does not report one) returning them.
        interrupt: once requested (:mod:`kairos.cli.bench.interrupt`: SIGINT, SIGTERM), no request
            is sent any more, those in flight are cancelled (their connections closed) and counted
            in ``cancelled``, those not sent yet are left out; the result covers what finished.

    Raises:
        BenchError: bad URL, unreachable server, no model, empty workload.
    """
    import aiohttp

    url = check_url(cfg.url)
    stop = interrupt.attach() if interrupt is not None else asyncio.Event()
    connector = aiohttp.TCPConnector(limit=cfg.max_concurrency or 0)
    auth = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None),
                                     trust_env=True, headers=auth) as session:
        model, max_len = await probe(session, url, cfg.model)
        reqs = list(workload(max_len) if callable(workload) else workload)
        if not reqs:
            raise BenchError("the workload has no requests")
        metrics_before = await scrape_metrics(session, url)
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        n_failed = 0

        async def task(i: int, r: WorkloadRequest) -> Outcome:
            nonlocal n_failed
            queued_s = time.perf_counter() - t0
            state = StreamState()
            sent_s: float | None = None
            try:
                async with sem if sem is not None else contextlib.nullcontext():
                    sent_s = time.perf_counter() - t0
                    bar.started(i, r.output_tokens, state.chunks)
                    out = await send_one(session, url, i, r, model, t0, cfg.request_timeout_s, cfg.prompt_seed,
                                         state)
            except asyncio.CancelledError:
                if not stop.is_set() or sent_s is None:
                    raise  # cancelled from outside, or interrupted before it was sent: not counted
                out = Outcome(i, r, sent_s, state, "cancelled: the run was interrupted", state.server_id,
                              error_code="cancelled", cancelled=True)
            out.queued_s = queued_s
            if not out.cancelled:
                n_failed += out.error is not None
                bar.update(n_failed, i)
            return out

        async def ticker() -> None:  # the progress moves on while no request finishes (long ones draining)
            while True:
                await asyncio.sleep(PROGRESS_TICK_S)
                bar.tick()

        t0 = time.perf_counter()
        bar = ProgressReporter(len(reqs), enabled=cfg.progress, interval_s=cfg.progress_interval_s,
                               clock=time.perf_counter)
        tasks: list[asyncio.Task] = []
        ticking = asyncio.create_task(ticker()) if cfg.progress else None
        try:
            for i, r in enumerate(reqs):
                delay = r.arrival_s - (time.perf_counter() - t0)
                if delay > 0 and not stop.is_set():
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(delay):  # the next arrival, or the interruption
                            await stop.wait()
                if stop.is_set():
                    break
                tasks.append(asyncio.create_task(task(i, r)))
            if tasks and not stop.is_set():
                stopped, finished = asyncio.create_task(stop.wait()), asyncio.create_task(asyncio.wait(tasks))
                await asyncio.wait([stopped, finished], return_when=asyncio.FIRST_COMPLETED)
                stopped.cancel()
                finished.cancel()  # asyncio.wait leaves the requests running
            for t in tasks:  # interrupted: the requests in flight are cancelled (connections closed)
                t.cancel()
            got = await asyncio.gather(*tasks, return_exceptions=True)
            for g in got:
                if isinstance(g, BaseException) and not isinstance(g, asyncio.CancelledError):
                    raise g
            sent = [g for g in got if isinstance(g, Outcome)]
            outcomes = [o for o in sent if not o.cancelled]
            send_span_s = max(o.sent_s for o in sent) - min(o.sent_s for o in sent) if sent else 0.0
        finally:
            for t in [*tasks, *([ticking] if ticking else [])]:
                t.cancel()
            bar.close()
        duration_s = time.perf_counter() - t0

        ids = sorted({o.server_id for o in outcomes if o.server_id})
        decisions = await lookup_decisions(session, url, ids) if ids and cfg.lookup_records else {}
        source: str | None
        deflections: int | None
        if not cfg.lookup_records:
            source, deflections = None, None
        elif decisions:
            source = "requests"
            deflections = sum(d.get("decision") == "deflect" for d in decisions.values())
        else:
            delta = deflect_delta(metrics_before, await scrape_metrics(session, url))
            source = "metrics" if delta is not None else None
            deflections = None if delta is None else int(round(delta))

    records = [make_record(o.req, o.sent_s, o.state.chunks, output_tokens=o.state.usage_completion_tokens,
                           error=o.error, record=decisions.get(o.server_id or ""),
                           cached_tokens=o.state.cached_tokens)
               for o in outcomes]
    return BenchResult(records=records, outcomes=outcomes, model=model, sent=len(sent), duration_s=duration_s,
                       send_span_s=send_span_s, deflections=deflections, deflections_source=source,
                       requests=len(reqs), interrupted=interrupt.name if interrupt is not None else None,
                       cancelled=len(sent) - len(outcomes))
