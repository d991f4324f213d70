"""``kairos bench``: replay a workload against a live OpenAI-compatible ingress and measure it.

Behaviour follows ``vllm bench serve`` (vLLM ``vllm/benchmarks/serve.py`` and
``vllm/benchmarks/lib/endpoint_request_func.py``, ``async_request_openai_completions``):

* **Open loop.** Each :class:`~kairos.core.workload.workloads.WorkloadRequest` is sent at its ``arrival_s``
  offset (seconds since the bench start, as given by the workload) without waiting for earlier
  requests, like ``vllm bench serve --request-rate``. ``max_concurrency`` (like
  ``--max-concurrency``) bounds the requests in flight; a request waiting for a slot is sent
  late, and, as in vLLM, its TTFT is measured from the moment it is actually sent.
* **Request.** ``POST {url}/v1/completions`` with ``prompt`` = a list of ``prompt_tokens`` token
  ids (exact prompt length, no tokenizer needed; see :func:`prompt_token_ids`), ``max_tokens`` =
  ``output_tokens``, ``stream: true``, ``ignore_eos: true`` (vLLM extension, like vLLM's
  ``--ignore-eos``) and ``stream_options: {"include_usage": true}``.
* **Timing.** Every SSE event is stamped with ``time.perf_counter()`` when the bytes carrying it
  are read, converted to seconds since the bench start. TTFT (ms) = first content chunk − send
  time; the token times feed :func:`kairos.core.workload.serving_metrics.summarize`, the same code the simulator uses,
  so TBT (ms) is the gap between consecutive tokens as the client sees them.
* **Tokens per chunk.** A chunk carries ``usage.completion_tokens`` growth if the server streams
  cumulative usage (vLLM ``continuous_usage_stats``), else ``len(logprobs.tokens)`` if present,
  else one token — vLLM's client counts every chunk with choices as one token too. Unlike vLLM,
  a pure finish marker (empty text *and* a ``finish_reason``, as the Kairos ingress sends) is
  not a token. A chunk of k tokens records k equal times (gaps of 0 ms), see
  :class:`~kairos.core.workload.serving_metrics.RequestRecord`. A chunk without generated text (an empty first chunk, a
  role-only chat delta) carries no token unless its cumulative usage or logprobs say it does (a
  special token), so TTFT is the first chunk that *generated* something. Here we differ from vLLM,
  whose client takes TTFT at the first chunk with ``choices`` even if its text is empty: a server
  that sends an empty chunk at once would get a TTFT of a few ms. ``output_tokens`` is the final ``usage`` count when the server reports one (as vLLM does),
  else the tokens counted; the run warns when the server sent no usage at all.
* **Figures** are :func:`kairos.core.workload.serving_metrics.serving_metrics` (``vllm bench serve``'s names and
  definitions: throughputs, mean/median/P99 TTFT, TPOT, ITL, E2EL, goodput) beside the paper's
  metrics (:func:`kairos.core.workload.serving_metrics.summarize`), and the offered vs achieved request rate.
* **Progress**: a tqdm bar when stderr is a terminal, else one line every ``progress_interval_s``
  (so a redirected run, e.g. under ``make run``, still shows it is alive).
* **Failures** are counted, never fatal: an HTTP status ≠ 200, an ``error`` object in the stream,
  a stream that ends without ``data: [DONE]``, a connection error, or no answer within
  ``request_timeout_s`` (seconds, whole request). Only usage errors (bad URL, server unreachable
  at start, bad workload) raise :class:`BenchError`.
* **Deflections.** After the run, ``GET {url}/v1/requests/{id}`` (the id the ingress returned in
  the stream's ``id``, or the ``x-request-id`` header) for every request that got one, counting
  ``decision == "deflect"`` and setting ``RequestRecord.deflected``. If no record is found at all
  (e.g. the endpoint 404s), fall back to the delta of the ``kairos_decisions_total`` (or
  ``kairos_dispatcher_decisions_total``) counter with ``decision="deflect"`` between ``GET
  {url}/metrics`` before and after the run; if that fails too, deflections are ``None``.

Pure pieces (no I/O, unit-tested): :class:`SSEParser`, :class:`StreamState`, :func:`make_record`,
:func:`parse_deflect_counter`, :func:`build_report`.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from kairos.core.workload.serving_metrics import RequestRecord, format_serving, format_table, serving_metrics, summarize
from kairos.core.workload.workloads import DEFAULT_MAX_MODEL_LEN, WorkloadRequest

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_REQUEST_TIMEOUT_S = 300.0
LOOKUP_CONCURRENCY = 16  #: parallel GET /v1/requests/{id} after the run
LOOKUP_TIMEOUT_S = 10.0  #: per lookup / metrics scrape / model probe, seconds
DEFAULT_PROGRESS_INTERVAL_S = 10.0  #: progress line period when stderr is not a terminal, seconds
#: Prometheus sample names whose ``decision="deflect"`` series count deflections (summed)
DEFLECT_COUNTERS: tuple[str, ...] = ("kairos_decisions_total", "kairos_dispatcher_decisions_total")


class BenchError(Exception):
    """A usage error: bad URL or option, server unreachable at start, bad workload. The CLI exits 2."""


# --- pure helpers ------------------------------------------------------------------------------------

def check_url(url: str) -> str:
    """The base URL without a trailing slash.

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
    return str(u).rstrip("/")


def prompt_token_ids(index: int, n: int) -> list[int]:
    """Deterministic prompt of exactly ``n`` token ids in ``[1, 1000]`` for the ``index``-th request.

    Range-based: id k is ``(index + k) % 1000 + 1``; the second id is overwritten with
    ``(index // 1000) % 1000 + 1`` so that two requests (index < 10⁶) never share a prefix and a
    prefix cache cannot reuse one request's KV for another (vLLM's random dataset offsets its
    token ids per request for the same reason).
    """
    ids = [(index + k) % 1000 + 1 for k in range(n)]
    if n > 1:
        ids[1] = (index // 1000) % 1000 + 1
    return ids


def request_body(req: WorkloadRequest, index: int, model: str) -> dict[str, Any]:
    """The JSON body of ``POST /v1/completions`` for one workload request."""
    return {"model": model, "prompt": prompt_token_ids(index, req.prompt_tokens), "max_tokens": req.output_tokens,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}


class SSEParser:
    """Incremental ``text/event-stream`` parser (WHATWG HTML "server-sent events" rules).

    :meth:`feed` takes raw bytes as they arrive and returns the ``data`` of every event completed
    by them: the event's ``data:`` lines joined with ``"\\n"`` (one leading space after the colon is
    dropped). Lines end with ``\\n``, ``\\r\\n`` or ``\\r``; a blank line ends an event; lines
    starting with ``:`` are comments (keep-alives) and ignored, as are ``event``/``id``/``retry``
    fields; an event without data lines is not returned. UTF-8 split across reads is handled.
    :meth:`close` returns a last event that lacks its blank line (lenient, like vLLM's
    ``StreamedResponseHandler``).
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buf = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buf += self._decoder.decode(chunk)
        out: list[str] = []
        while True:
            i = next((j for j, ch in enumerate(self._buf) if ch in "\r\n"), -1)
            if i < 0:
                break
            if self._buf[i] == "\r" and i + 1 == len(self._buf):
                break  # a "\r" at the end may be the first half of "\r\n"
            line = self._buf[:i]
            skip = 2 if self._buf.startswith("\r\n", i) else 1
            self._buf = self._buf[i + skip:]
            self._line(line, out)
        return out

    def close(self) -> list[str]:
        out: list[str] = []
        rest = self._buf + self._decoder.decode(b"", final=True)
        self._buf = ""
        for line in rest.splitlines():
            self._line(line, out)
        self._line("", out)
        return out

    def _line(self, line: str, out: list[str]) -> None:
        if not line:
            if self._data:
                out.append("\n".join(self._data))
                self._data = []
            return
        if line.startswith(":"):
            return
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)


def _error_message(err: Any) -> str:
    if isinstance(err, dict):
        msg = err.get("message") or err.get("msg") or json.dumps(err)
        code = err.get("code")
        return f"{msg} ({code})" if code else str(msg)
    return str(err)


def _int_or_none(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


@dataclass
class StreamState:
    """What one streamed response has delivered so far (pure: times are passed in).

    ``chunks`` holds ``(time_s, tokens)`` for every content chunk (seconds since the bench start).
    """

    chunks: list[tuple[float, int]] = field(default_factory=list)
    usage_completion_tokens: int | None = None  #: last ``usage.completion_tokens`` seen
    server_id: str | None = None  #: the response ``id`` (request id assigned by the server)
    done: bool = False  #: ``data: [DONE]`` seen
    error: str | None = None  #: first error (an ``error`` object or malformed data)
    _cumulative: int = 0  #: tokens accounted for by per-chunk usage

    def on_data(self, data: str, t_s: float) -> None:
        """Apply one SSE event's data that arrived at ``t_s`` (seconds)."""
        if data.strip() == "[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(data)
        except ValueError:
            self.error = self.error or f"malformed SSE data: {data[:200]!r}"
            return
        if not isinstance(obj, dict):
            self.error = self.error or f"malformed SSE data: {data[:200]!r}"
            return
        if obj.get("error"):
            self.error = self.error or _error_message(obj["error"])
            return
        if self.server_id is None and isinstance(obj.get("id"), str):
            self.server_id = obj["id"]
        usage = obj.get("usage")
        ct = _int_or_none(usage.get("completion_tokens")) if isinstance(usage, dict) else None
        if ct is not None:
            self.usage_completion_tokens = ct
        choices = obj.get("choices")
        if not choices or not isinstance(choices, list) or not isinstance(choices[0], dict):
            return
        n = chunk_tokens(choices[0], ct, self._cumulative)
        if ct is not None:
            self._cumulative = max(self._cumulative, ct)
        if n > 0:
            self.chunks.append((t_s, n))


def chunk_tokens(choice: dict[str, Any], usage_completion_tokens: int | None, counted_so_far: int) -> int:
    """Output tokens carried by one streamed choice (see the module docstring).

    Args:
        choice: ``choices[0]`` of a completions (``text``) or chat (``delta.content``) chunk.
        usage_completion_tokens: the chunk's cumulative ``usage.completion_tokens`` or None.
        counted_so_far: tokens already accounted for by earlier chunks' cumulative usage.
    """
    if usage_completion_tokens is not None:
        return max(usage_completion_tokens - counted_so_far, 0)
    lp = choice.get("logprobs")
    if isinstance(lp, dict):
        toks = lp.get("tokens") if isinstance(lp.get("tokens"), list) else lp.get("content")
        if isinstance(toks, list) and toks:
            return len(toks)
    text = choice.get("text")
    if text is None and isinstance(choice.get("delta"), dict):
        text = choice["delta"].get("content")
    return 1 if text else 0  # a role-only delta, an empty first chunk or a pure finish marker carries none


def make_record(req: WorkloadRequest, sent_s: float, chunks: Sequence[tuple[float, int]], *,
                output_tokens: int | None = None, error: str | None = None,
                record: dict[str, Any] | None = None) -> RequestRecord:
    """Turn one request's recorded chunk arrivals into a :class:`RequestRecord`.

    Args:
        req: the workload request (id and prompt length are kept).
        sent_s: when the request was sent, seconds since the bench start (the record's arrival).
        chunks: ``(arrival_s, tokens)`` per content chunk, seconds since the bench start, in order.
        output_tokens: the server's count (final ``usage``); default: the tokens in ``chunks``.
        error: failure reason or None. A request without any token and no error gets
            ``"no output tokens in the stream"``.
        record: the server's decision record (``GET /v1/requests/{id}``) if found: ``deflected``
            is ``decision == "deflect"`` and the TTFT components (ms) come from its ``measured``
            object (server-side timestamps), so the live run has a P95 breakdown like the simulator.

    Returns:
        ``token_times_s`` with each chunk's time repeated once per token; ``ttft_ms`` =
        (first chunk − ``sent_s``) × 1000, None without tokens.
    """
    record = record or {}
    measured = record.get("measured") if isinstance(record.get("measured"), dict) else {}

    def comp(key: str) -> float | None:
        v = measured.get(key)
        return float(v) if isinstance(v, (int, float)) else None

    times = [t for t, k in chunks for _ in range(k)]
    if not times and error is None:
        error = "no output tokens in the stream"
    return RequestRecord(
        id=req.id, arrival_s=sent_s, prompt_tokens=req.prompt_tokens,
        output_tokens=len(times) if output_tokens is None else output_tokens,
        ttft_ms=(times[0] - sent_s) * 1000.0 if times else None, token_times_s=times,
        deflected=record.get("decision") == "deflect", error=error,
        prefill_queue_ms=comp("prefill_queue_ms"), prefill_exec_ms=comp("prefill_exec_ms"),
        kv_transfer_ms=comp("kv_transfer_ms"), decode_queue_ms=comp("decode_queue_ms"))


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


# --- I/O ------------------------------------------------------------------------------------------

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


@dataclass
class Outcome:
    """One request's raw result."""

    index: int
    req: WorkloadRequest
    sent_s: float  #: seconds since the bench start
    state: StreamState
    error: str | None
    server_id: str | None


@dataclass
class BenchResult:
    records: list[RequestRecord]
    outcomes: list[Outcome]
    model: str
    sent: int
    duration_s: float  #: bench start → last request finished, seconds
    send_span_s: float  #: first → last request actually sent, seconds (achieved rate = (sent − 1) / span)
    deflections: int | None
    deflections_source: str | None  #: "requests" (GET /v1/requests/{id}), "metrics" or None


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
            raise BenchError(f"{url}/v1/models gave no model (HTTP {status}); pass --model")
        model = cards[0]["id"]
    ids = [c.get("id") for c in cards]
    if cards and model not in ids:
        raise BenchError(f"--model {model!r} is not served by {url} (served: {', '.join(map(str, ids))})")
    card = next((c for c in cards if c.get("id") == model), {})
    return model, _int_or_none(card.get("max_model_len"))


async def send_one(session, url: str, index: int, req: WorkloadRequest, model: str, t0: float,
                   timeout_s: float) -> Outcome:
    """Send one streaming request and record its chunk arrivals (never raises)."""
    body = request_body(req, index, model)
    state = StreamState()
    parser = SSEParser()
    error: str | None = None
    header_id: str | None = None
    sent_s = time.perf_counter() - t0
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                header_id = resp.headers.get("x-request-id")
                if resp.status != 200:
                    text = await resp.text()
                    try:
                        msg = _error_message(json.loads(text).get("error") or text)
                    except (ValueError, AttributeError):
                        msg = text.strip()[:300] or (resp.reason or "")
                    error = f"HTTP {resp.status}: {msg}"
                else:
                    async for data in resp.content.iter_any():
                        t = time.perf_counter() - t0
                        for ev in parser.feed(data):
                            state.on_data(ev, t)
                    t = time.perf_counter() - t0
                    for ev in parser.close():
                        state.on_data(ev, t)
                    if state.error is None and not state.done:
                        error = "stream ended before data: [DONE]"
    except TimeoutError:
        error = f"timeout after {timeout_s:g} s"
    except Exception as exc:  # aiohttp.ClientError, OSError, ...: the request failed, the run goes on
        error = f"{type(exc).__name__}: {exc}".rstrip(": ")
    return Outcome(index, req, sent_s, state, state.error or error, state.server_id or header_id)


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
            except Exception:  # a lookup failure only loses that record
                pass

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
                    ) -> BenchResult:
    """Probe the server, replay the workload open-loop, then collect deflections.

    Args:
        cfg: options; ``cfg.url`` is checked with :func:`check_url`.
        workload: the requests, or a function of the server's ``max_model_len`` (None if
            ``/v1/models`` does not report one) returning them.

    Raises:
        BenchError: bad URL, unreachable server, no model, empty workload.
    """
    import aiohttp

    url = check_url(cfg.url)
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
        bar = ProgressReporter(len(reqs), enabled=cfg.progress, interval_s=cfg.progress_interval_s)
        n_failed = 0

        async def task(i: int, r: WorkloadRequest) -> Outcome:
            nonlocal n_failed
            if sem is None:
                out = await send_one(session, url, i, r, model, t0, cfg.request_timeout_s)
            else:
                async with sem:
                    out = await send_one(session, url, i, r, model, t0, cfg.request_timeout_s)
            n_failed += out.error is not None
            bar.update(n_failed)
            return out

        t0 = time.perf_counter()
        tasks = []
        try:
            for i, r in enumerate(reqs):
                delay = r.arrival_s - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(task(i, r)))
            outcomes = list(await asyncio.gather(*tasks))
            send_span_s = max(o.sent_s for o in outcomes) - min(o.sent_s for o in outcomes)
        finally:
            for t in tasks:
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
                           error=o.error, record=decisions.get(o.server_id or ""))
               for o in outcomes]
    return BenchResult(records=records, outcomes=outcomes, model=model, sent=len(outcomes), duration_s=duration_s,
                       send_span_s=send_span_s, deflections=deflections, deflections_source=source)


class ProgressReporter:
    """Progress of a run on stderr: a tqdm bar when stderr is a terminal, else one plain line every
    ``interval_s`` seconds (and one at the end), so a redirected run still shows it is alive."""

    def __init__(self, total: int, *, enabled: bool, interval_s: float = DEFAULT_PROGRESS_INTERVAL_S,
                 stream=None, clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.done, self.failed = total, 0, 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled, self.interval_s, self.clock = enabled, interval_s, clock
        self.t0 = self.last = clock()
        self.printed = -1  #: ``done`` at the last progress line
        self.bar = None
        if enabled and _isatty(self.stream):
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="req", desc="bench", file=self.stream, dynamic_ncols=True)

    def update(self, failed: int) -> None:
        """One more request finished; ``failed`` is the failure count so far."""
        self.done += 1
        self.failed = failed
        if self.bar is not None:
            self.bar.set_postfix(failed=failed, refresh=False)
            self.bar.update(1)
        elif self.enabled and self.clock() - self.last >= self.interval_s:
            self.last = self.clock()
            self._line()

    def _line(self) -> None:
        self.printed = self.done
        print(f"bench: {self.done}/{self.total} requests done, {self.failed} failed, "
              f"{self.clock() - self.t0:.0f} s elapsed", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and self.printed != self.done:
            self._line()


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def build_report(result: BenchResult, *, url: str, workload: dict[str, Any], label: str = "live",
                 tbt_slo_ms: float = 70.0, ttft_slo_ms: float = 4000.0, max_concurrency: int | None = None,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, goodput_slo_ms: dict[str, float] | None = None,
                 save_records: bool = False) -> dict[str, Any]:
    """The JSON report: :func:`kairos.core.workload.serving_metrics.summarize`'s keys (ms; throughput over the bench's
    wall ``duration_s``) with ``deflections`` replaced by the measured count (None = unknown),
    plus ``label``, ``url``, ``model``, ``workload``, ``sent``, ``duration_s`` (s),
    ``deflections_source``, ``max_concurrency``, ``request_timeout_s``, ``tbt_slo_ms``,
    ``ttft_slo_ms``, ``errors`` ({message: count}), ``serving`` (:func:`kairos.core.workload.serving_metrics.serving_metrics`,
    ``vllm bench serve``'s keys; goodput under ``goodput_slo_ms``, default TTFT ≤ ``ttft_slo_ms``
    and TPOT ≤ ``tbt_slo_ms``), ``offered_rps`` (the workload's rate), ``achieved_rps`` (requests
    actually sent per second: (sent − 1) / first-to-last send span), ``usage_reported`` (responses
    that carried ``usage``) and, if ``save_records``, ``records``."""
    summary = summarize(result.records, tbt_slo_ms=tbt_slo_ms, ttft_slo_ms=ttft_slo_ms,
                        duration_s=result.duration_s)
    summary["deflections"] = result.deflections
    errors = Counter(r.error for r in result.records if r.error is not None)
    slos = goodput_slo_ms if goodput_slo_ms is not None else {"ttft": ttft_slo_ms, "tpot": tbt_slo_ms}
    report: dict[str, Any] = {
        "label": label, "url": url, "model": result.model, "workload": workload,
        "sent": result.sent, "duration_s": round(result.duration_s, 6), **summary,
        "serving": serving_metrics(result.records, duration_s=result.duration_s, goodput_slo_ms=slos),
        "goodput_slo_ms": slos, "offered_rps": workload.get("offered_rps"),
        "achieved_rps": round((result.sent - 1) / result.send_span_s, 3) if result.send_span_s > 0 else None,
        "usage_reported": sum(o.state.usage_completion_tokens is not None for o in result.outcomes),
        "deflections_source": result.deflections_source,
        "max_concurrency": max_concurrency, "request_timeout_s": request_timeout_s,
        "tbt_slo_ms": tbt_slo_ms, "ttft_slo_ms": ttft_slo_ms,
        "errors": dict(errors.most_common()),
    }
    if save_records:
        report["records"] = [{**msgspec.to_builtins(r), "server_id": o.server_id,
                              "scheduled_s": o.req.arrival_s}
                             for r, o in zip(result.records, result.outcomes)]
    return report


def format_report(report: dict[str, Any]) -> str:
    """What ``kairos bench`` prints on stdout for a :func:`build_report` report: ``vllm bench serve``'s
    result block (:func:`kairos.core.workload.serving_metrics.format_serving`), then the paper's metrics
    (:func:`kairos.core.workload.serving_metrics.format_table`) in one row labelled ``report["label"]``. Also renders a
    saved ``--json`` report (``tools.docgen.docgen``)."""
    serving = format_serving(report["serving"], extra=[
        ("Maximum request concurrency:", report.get("max_concurrency")),
        ("Request rate offered (req/s):", report["offered_rps"]),
        ("Request send rate achieved (req/s):", report["achieved_rps"])])
    table = format_table([{**report, "policy": report["label"], "rps": report["achieved_rps"]}], name_column="run")
    return f"{serving}\n{table}"


def parse_goodput(specs: Sequence[str]) -> dict[str, float]:
    """``vllm bench serve --goodput`` syntax: ``KEY:VALUE`` pairs (ms), keys ttft, tpot, e2el.

    Raises:
        BenchError: malformed pair, unknown key or a value that is not a positive number.
    """
    out: dict[str, float] = {}
    for spec in specs:
        key, sep, value = spec.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = float("nan")
        if not sep or key not in ("ttft", "tpot", "e2el") or not (ms > 0 and ms != float("inf")):
            raise BenchError(f"--goodput {spec!r}: expected ttft:MS, tpot:MS or e2el:MS with MS > 0")
        out[key] = ms
    return out


def bench_cli(*, url: str, workload: str, rps: float | None, duration: float | None, seed: int,
              model: str | None, max_concurrency: int | None, request_timeout: float, max_model_len: int | None,
              label: str, json_path: str | None, save_records: bool, progress: bool, tbt_slo_ms: float,
              ttft_slo_ms: float, goodput: Sequence[str] = (),
              progress_interval_s: float = DEFAULT_PROGRESS_INTERVAL_S, api_key: str | None = None) -> dict[str, Any]:
    """What ``kairos bench`` does: run, print ``vllm bench serve``'s result block and the paper's
    metrics table (stdout) and a summary (stderr), write JSON.

    Raises:
        BenchError: any usage error (the CLI exits 2).
    """
    import click

    from kairos.core.workload.workloads import WorkloadError, parse_workload

    url = check_url(url)
    from kairos.cli.main import check_workload_size
    try:
        check_workload_size(duration, [rps])
    except click.BadParameter as exc:
        raise BenchError(f"{exc.param_hint}: {exc.message}") from None
    if save_records and not json_path:
        raise BenchError("--save-records needs --json PATH")
    slos = parse_goodput(goodput) if goodput else None

    def make_workload(n: int) -> list[WorkloadRequest]:
        try:
            return parse_workload(workload, rps, duration, seed, max_model_len=n)
        except WorkloadError as exc:
            raise BenchError(f"--workload: {exc}") from None

    cache: dict[int, list[WorkloadRequest]] = {}

    def workload_fn(server_max_len: int | None) -> list[WorkloadRequest]:
        n = max_model_len or server_max_len or DEFAULT_MAX_MODEL_LEN
        if n not in cache:
            cache.clear()
            cache[n] = make_workload(n)
        return cache[n]

    workload_fn(None)  # workload errors before touching the network
    cfg = BenchConfig(url=url, model=model, max_concurrency=max_concurrency, request_timeout_s=request_timeout,
                      progress=progress, progress_interval_s=progress_interval_s, api_key=api_key)
    wl_info: dict[str, Any] = {"spec": workload, "rps": rps, "duration_s": duration, "seed": seed}
    result = asyncio.run(run_bench(cfg, workload_fn))
    wl = next(iter(cache.values()))
    span = wl[-1].arrival_s - wl[0].arrival_s
    wl_info.update(requests=len(wl), offered_rps=round((len(wl) - 1) / span, 3) if span > 0 else None)
    report = build_report(result, url=url, workload=wl_info, label=label, tbt_slo_ms=tbt_slo_ms,
                          ttft_slo_ms=ttft_slo_ms, max_concurrency=max_concurrency,
                          request_timeout_s=request_timeout, goodput_slo_ms=slos, save_records=save_records)
    click.echo(format_report(report))
    if report["usage_reported"] == 0 and report["completed"]:
        click.echo("kairos bench: warning: the server sent no usage; output tokens are counted as one per chunk "
                   "with text, which undercounts when a chunk carries several tokens", err=True)
    src = f" (from {report['deflections_source']})" if report["deflections_source"] else ""
    click.echo(f"sent {report['sent']}, completed {report['completed']}, failed {report['failed']} in "
               f"{report['duration_s']:.1f} s; deflections: {report['deflections']}{src}", err=True)
    for msg, n in list(report["errors"].items())[:5]:
        click.echo(f"  {n} x {msg}", err=True)
    if json_path:
        p = Path(json_path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(report, indent=2) + "\n")
        click.echo(f"wrote {json_path}", err=True)
    return report
