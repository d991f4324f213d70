"""The node agent's vLLM backend: a vLLM OpenAI server beside the agent (``KAIROS_BACKEND=vllm``).

Requests go to the server over HTTP (:class:`~kairos.engines.vllm.http.EngineClient`,
``POST /v1/completions``; the bodies are built in :mod:`kairos.engines.vllm.api`), engine state comes from
the ``kairos.engines.vllm.plugin`` scheduler plugin's ZMQ stream (:class:`kairos.engines.vllm.subscriber.EngineStateSubscriber`,
contract A): every snapshot updates the state the agent's heartbeats report, every snapshot
carrying a ``StepRecord`` becomes a :class:`~kairos.engines.base.StepOutput` (both
translations: :mod:`kairos.engines.vllm.state`). This module is the request lifecycle between
them: phases, retries, failures, availability. No ``/metrics`` scraping on the hot path.

Paths (vLLM's NIXL P/D protocol, ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/``):

* keep, prefill node — :meth:`VllmBackend.add_prefill`: ``max_tokens`` 1 with
  ``kv_transfer_params {"do_remote_decode": true}``; the answer's ``kv_transfer_params`` are kept
  (phase ``held``) and travel to the decode agent in the ``KvHandoff`` (:meth:`handoff_params`).
  vLLM keeps the blocks until the decode server has read them (then frees them itself) or their
  lease ``kv_lease_duration`` (default 30 s, extended by the decode server's heartbeats while its
  request waits) expires; :meth:`release` only forgets the request.
* keep, decode node — :meth:`add_remote_decode`: streamed request with those
  ``kv_transfer_params``; vLLM pulls the KV, computes the last prompt token and decodes.
  :meth:`pull_kv` returns when the first token arrived (the KV is in place by then).
* deflect, decode node — :meth:`add_deflected`: streamed request with
  ``vllm_xargs.kairos_prefill_chunks`` = χ_i − B_decision (:func:`kairos.engines.vllm.api.engine_prefill_chunks`).

Cancel (:meth:`abort`) closes the HTTP request; vLLM aborts a request whose client disconnected
(``with_cancellation`` on the completions route) and frees its blocks. A keep-path request cancelled
after its prefill (phase ``held``) has no HTTP request left on the prefill node: its blocks are
freed when the decode server's request for it is aborted before reading them (the decode side then
notifies the prefill side, ``NixlConnector.request_finished``), or by the lease — docs/services.md.
A keep-path decode that fails for good before its first token (an engine 4xx, or retries spent)
frees the prefill node's blocks at once through its own server (:func:`kairos.engines.vllm.api.kv_release_body`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import structlog

from kairos.contracts.errors import ErrorCode
from kairos.contracts.wire import InferenceRequest
from kairos.core.engine_model import EngineState, GroundTruth
from kairos.core.model.latency import LatencyModel
from kairos.core.vocabulary import RequestPhase, RequestRole
from kairos.engines.base import EngineBackend, EngineEvents
from kairos.engines.vllm.api import (EngineApiError, EngineHttpError, cached_tokens, decode_body, engine_prefill_chunks,
                                     prefill_body, prefill_result, require_kv_blocks, unsafe_seed)
from kairos.engines.vllm.http import KV_RELEASE_TIMEOUT_S, EngineClient  # noqa: F401  (re-exported)
from kairos.engines.vllm.state import (_VReq, engine_state, step_output,  # noqa: F401  (re-exported)
                                       track_prefills)
from kairos.engines.vllm.subscriber import EngineStateSubscriber, follow

log = structlog.get_logger("kairos.node_agent.vllm")

#: times a keep-path decode that failed before its first token is sent again (see VllmBackend._serve);
#: never after a 4xx: the engine refused the request itself
REMOTE_DECODE_RETRIES = 2
#: the finish reasons a request ends with on the wire (another of vLLM's, e.g. ``error``, is sent as ``stop``)
FINISH_REASONS = ("stop", "length", "abort")


def wire_finish(reason: str | None) -> str | None:
    """vLLM's ``finish_reason`` as the wire carries it (:data:`FINISH_REASONS`; None stays None)."""
    return reason if reason is None or reason in FINISH_REASONS else "stop"


def failure(exc: Exception, url: str) -> tuple[int, ErrorCode, str]:
    """``(HTTP status, code, message)`` of a request that failed for good with ``exc``: vLLM's own 4xx
    (:class:`EngineHttpError` with ``client_error``: the request itself is wrong) is
    ``engine_rejected_request`` with vLLM's status and message; anything else ``502 engine_error``."""
    if isinstance(exc, EngineHttpError) and exc.client_error:
        return exc.status, ErrorCode.ENGINE_REJECTED_REQUEST, f"the engine refused the request: {exc.engine_message}"
    return ErrorCode.ENGINE_ERROR.status, ErrorCode.ENGINE_ERROR, f"vLLM at {url}: {exc}"


def needs_prompt_ids(r: _VReq) -> bool:
    """Whether ``r`` is a migrated text prompt whose continuation must be sent as token ids (its
    prompt as this engine tokenizes it, then the output ids it resumes after; issue 33) and whose
    prompt is not tokenized yet."""
    res = r.req.resume
    return (res is not None and res.output_token_ids is not None and r.req.prompt_token_ids is None
            and r.prompt_ids is None and r.req.prompt_text is not None)


class VllmBackend(EngineBackend):
    """A local vLLM OpenAI server with the ``kairos.engines.vllm.plugin`` plugin (see module docstring).

    Args:
        role: ``prefill`` or ``decode``.
        model: the latency profile (the step predictions in :class:`StepOutput`).
        engine_url: the server's base URL (``http://127.0.0.1:8100``).
        state_addr: the plugin's ZMQ PUB address (the engine's ``KAIROS_ENGINE_STATE_ADDR``).
        stale_after_ms: no snapshot for this long → :attr:`available` False (the agent reports
            ``accepting=False`` and refuses jobs). The plugin sends at least every 100 ms.
        api_key: the key the server requires (its ``VLLM_API_KEY``): every call sends
            ``Authorization: Bearer <key>``; None: no header (an open server).
    """

    def __init__(self, role: str, model: LatencyModel, engine_url: str, state_addr: str,
                 stale_after_ms: float = 2000.0, api_key: str | None = None) -> None:
        self.role = role
        self.model = model
        self.url = engine_url.rstrip("/")
        self.state_addr = state_addr
        self.stale_after_ms = stale_after_ms
        self.http = EngineClient(self.url, api_key)  #: every HTTP call to the server (vllm_http.py)
        self.served_model: str | None = None  #: the server's model id (GET /v1/models), set by run()
        self.snapshot: Any = None  #: last kairos.engines.vllm.plugin EngineSnapshot
        self._snap_mono = 0.0
        self._reqs: dict[str, _VReq] = {}
        self._allocated: list[str] = []
        self._started: list[tuple[str, int, int]] = []  #: keep-path prefills started since the last step record
        self._events: EngineEvents | None = None
        self._ready = asyncio.Event()
        self.snapshots = 0  #: snapshots received (tests, debugging)
        self._stop: asyncio.Event | None = None  #: run()'s stop event
        self._ready_task: asyncio.Future | None = None  #: waiting for the server (_become_ready)

    @classmethod
    def from_config(cls, cfg: Any, model: LatencyModel, truth: GroundTruth | None = None) -> "VllmBackend":
        """The server's URL, state stream, staleness and key from an AgentConfig (``truth`` is ignored:
        the engine's steps take what they take).

        Raises:
            ConfigError: the key file cannot be read (``AgentConfig.engine_key``)."""
        return cls(cfg.role, model, cfg.engine_url, cfg.engine_state_addr, stale_after_ms=cfg.engine_stale_after_ms,
                   api_key=cfg.engine_key())

    # -- availability / state -------------------------------------------------------------------
    @property
    def available(self) -> bool:  # type: ignore[override]
        """The server answered its model list since the engine (re)started and, once its state
        stream has started, the stream is fresh (a snapshot within ``stale_after_ms``; an engine
        that never ran a request may not have published yet). False from the moment the stream's
        connection closes or a new engine process publishes (:meth:`_engine_lost`)."""
        if not self._ready.is_set():
            return False
        return self.snapshot is None or (time.monotonic() - self._snap_mono) * 1000.0 <= self.stale_after_ms

    async def confirm_available(self, timeout_s: float) -> bool:
        """:attr:`available`, or, when only the state stream is late (a loaded machine can starve
        the engine's publisher thread for seconds), whether the server answers ``GET /health``
        within ``timeout_s`` seconds: vLLM queues what it is sent, so a late stream alone is no
        reason to refuse a request the dispatcher already routed here."""
        if self.available:
            return True
        if not self._ready.is_set():
            return False
        ok = await self.http.healthy(timeout_s)
        log.warning("engine_state_late", url=self.url, health_ok=ok,
                    state_age_ms=round((time.monotonic() - self._snap_mono) * 1000.0, 1))
        return ok

    def state(self) -> EngineState:
        """Heartbeat state from the last snapshot (:func:`~kairos.engines.vllm.state.engine_state`)."""
        return engine_state(self.role, self.snapshot, self._reqs)

    def phase(self, req_id: str) -> RequestPhase | None:
        r = self._reqs.get(req_id)
        return None if r is None else r.phase

    def handoff_params(self, req_id: str) -> dict[str, Any] | None:
        r = self._reqs.get(req_id)
        return None if r is None else r.kv_params

    # -- lifecycle ------------------------------------------------------------------------------
    def add_prefill(self, req: InferenceRequest) -> None:
        self._add(_VReq(req=req, kind=RequestRole.PREFILL, phase=RequestPhase.PREFILLING, remaining=req.prompt_tokens))

    def add_remote_decode(self, req: InferenceRequest, kv_transfer_params: dict[str, Any] | None = None) -> None:
        if not kv_transfer_params:
            raise EngineApiError(f"{req.request_id}: a vLLM decode node needs the prefill server's kv_transfer_params "
                                 "(was the prefill node running the emulated backend?)")
        require_kv_blocks(kv_transfer_params, req.request_id)  # never forwarded: it would kill the engine
        r = _VReq(req=req, kind=RequestRole.REMOTE_DECODE, phase=RequestPhase.AWAITING_KV, kv_params=dict(kv_transfer_params))
        r.kv_ready = asyncio.get_running_loop().create_future()
        self._add(r)
        self._allocated.append(req.request_id)  # vLLM allocates and pulls by itself once submitted

    def add_deflected(self, req: InferenceRequest, chunk_schedule: list[int], decision_batch_size: int = 0) -> None:
        self._add(_VReq(req=req, kind=RequestRole.DEFLECT, phase=RequestPhase.DEFLECTED_PREFILL, chunk_schedule=list(chunk_schedule),
                        engine_chunks=engine_prefill_chunks(list(chunk_schedule), decision_batch_size),
                        remaining=req.prompt_tokens))

    def _add(self, r: _VReq) -> None:
        rid = r.req.request_id
        if rid in self._reqs:
            raise EngineApiError(f"request {rid} is already on this engine")
        if r.req.prompt_text is None and r.req.prompt_token_ids is None:
            raise EngineApiError(f"request {rid} has no prompt text or token ids (a real engine needs the prompt)")
        self._reqs[rid] = r
        r.submitted_mono = time.monotonic()
        r.task = asyncio.get_running_loop().create_task(self._serve(r), name=f"vllm:{rid}")

    def kv_arrived(self, req_id: str) -> None:
        r = self._reqs.get(req_id)
        if r is not None and r.phase is RequestPhase.AWAITING_KV:
            r.phase = RequestPhase.DECODING

    def release(self, req_id: str) -> None:
        """Prefill node: the decode node has the KV. vLLM frees the blocks itself once read (NIXL
        notification), so this only forgets the request."""
        r = self._reqs.get(req_id)
        if r is not None and r.phase is RequestPhase.HELD:
            del self._reqs[req_id]

    def abort(self, req_id: str) -> bool:
        """Close ``req_id``'s HTTP request (vLLM aborts it and frees its blocks). Returns whether
        a request was running here. A ``held`` prefill has nothing left to close (module docstring)."""
        r = self._reqs.pop(req_id, None)
        if r is None:
            return False
        if r.kv_ready is not None and not r.kv_ready.done():
            r.kv_ready.set_result(False)
        if r.task is not None and not r.task.done():
            r.task.cancel()
            return True
        return False

    def take_allocated(self) -> list[str]:
        out, self._allocated = self._allocated, []
        return out

    async def pull_kv(self, src_node: str, req_id: str, kv_tokens: int) -> float:
        """Wait until vLLM has pulled the KV and produced the first token (or the request ended);
        returns ms since the decode request was submitted (queueing + transfer + last prompt token)."""
        r = self._reqs.get(req_id)
        if r is None or r.kv_ready is None:
            return 0.0
        await asyncio.shield(r.kv_ready)
        return (time.monotonic() - r.submitted_mono) * 1000.0

    # -- requests -------------------------------------------------------------------------------
    async def _serve(self, r: _VReq) -> None:
        """Run ``r``'s HTTP request; on failure end it with an explicit error: the engine's 4xx
        (``engine_rejected_request``, vLLM's message: the request itself is wrong), else
        ``502 engine_error``.

        A keep-path decode that fails before its first token, other than by a 4xx, is sent again (up
        to :data:`REMOTE_DECODE_RETRIES` times): vLLM 0.32.0's NIXL handshake with a new prefill peer
        waits a fixed 5 s for its reply (``nixl/base_worker.py``), which a busy CPU prefill server can
        miss; the prefill side keeps the blocks for their lease, so the same ``kv_transfer_params``
        still work. One that fails for good before its first token releases the prefill node's
        blocks at once (:meth:`EngineClient.release_kv`)."""
        rid = r.req.request_id
        attempts = 0
        await self._ready.wait()
        while True:
            try:
                if needs_prompt_ids(r):  # a migrated text prompt: continued after its output ids
                    r.prompt_ids = await self.http.tokenize(self.served_model or r.req.model, r.req.prompt_text)
                if r.kind is RequestRole.PREFILL:
                    await self._prefill(r)
                else:
                    await self._stream(r)
                return
            except asyncio.CancelledError:
                raise
            except (aiohttp.ClientError, asyncio.TimeoutError, EngineApiError, ValueError) as exc:
                if self._reqs.get(rid) is not r:
                    return
                refused = isinstance(exc, EngineHttpError) and exc.client_error  # the same body fails again
                remote = r.kind is RequestRole.REMOTE_DECODE
                if (remote and r.tokens_out == 0 and not refused
                        and attempts < REMOTE_DECODE_RETRIES):
                    attempts += 1
                    log.warning("remote_decode_retry", request_id=rid, attempt=attempts, error=repr(exc))
                    continue
                del self._reqs[rid]
                if r.kv_ready is not None and not r.kv_ready.done():
                    r.kv_ready.set_result(False)
                if remote and r.tokens_out == 0 and r.kv_params:
                    self.http.release_kv(rid, r.kv_params)
                log.warning("engine_request_failed", request_id=rid, error=repr(exc))
                if self._events is not None:
                    await self._events.on_failed(rid, *failure(exc, self.url))
                return

    async def _prefill(self, r: _VReq) -> None:
        rid = r.req.request_id
        params, _n = prefill_result(await self.http.complete(prefill_body(r.req, self.served_model, r.prompt_ids)), rid)
        if self._reqs.get(rid) is not r:  # aborted meanwhile
            return
        r.kv_params, r.phase, r.remaining = params, RequestPhase.HELD, 0
        if self._events is not None:
            await self._events.on_prefill_done(rid)

    async def _stream(self, r: _VReq) -> None:
        rid = r.req.request_id
        if r.kind is RequestRole.DEFLECT and (why := unsafe_seed(r.req.sampling)) is not None:  # it would kill the engine
            raise EngineHttpError(400, why)
        remote = r.kind is RequestRole.REMOTE_DECODE
        body = decode_body(r.req, self.served_model, kv_transfer_params=r.kv_params if remote else None,
                           prefill_chunks=r.engine_chunks or None, prompt_ids=r.prompt_ids)
        index, finish, usage, stop_reason = 0, None, None, None
        async for d in self.http.stream(body):
            if d.usage is not None:
                usage = d.usage
            if d.finish_reason is not None:
                finish, stop_reason = d.finish_reason, d.stop_reason
            if d.token_count > 0 and self._reqs.get(rid) is r:
                if index == 0:
                    r.remaining = 0
                    if r.kv_ready is not None and not r.kv_ready.done():
                        r.kv_ready.set_result(True)
                    if r.phase is RequestPhase.DEFLECTED_PREFILL:
                        r.phase = RequestPhase.DECODING
                lp = {} if d.logprobs is None else {"logprobs": d.logprobs}  # only asked-for logprobs
                await self._events.on_tokens(rid, index, d.token_count, d.text, wire_finish(d.finish_reason), **lp,
                                             stop_reason=d.stop_reason if d.finish_reason is not None else None,
                                             token_ids=d.token_ids if d.token_ids and len(d.token_ids) == d.token_count
                                             else None)
                index += d.token_count
                r.tokens_out = index
        if self._reqs.get(rid) is not r:
            return
        del self._reqs[rid]
        if r.kv_ready is not None and not r.kv_ready.done():
            r.kv_ready.set_result(index > 0)
        if finish is None:
            raise EngineApiError("the engine's stream ended without a finish_reason")
        await self._events.on_finished(rid, wire_finish(finish), cached_tokens(usage), stop_reason=stop_reason)

    # -- driver ---------------------------------------------------------------------------------
    def _on_snapshot(self, snap: Any) -> list[tuple[str, int, int]]:
        """Update the state. Returns the keep-path prefills seen computing for the first time since
        the last step record ``(rid, tokens computed, 0)``: collected over every snapshot (a step's
        own message can be dropped or follow the one that showed the progress) and handed out, then
        cleared, when ``snap`` carries a step record."""
        self.snapshot, self._snap_mono = snap, time.monotonic()
        self.snapshots += 1
        started = self._started
        started += track_prefills(snap, self._reqs)
        if snap.step_record is None:
            return []
        self._started = []
        return started

    async def _become_ready(self, stop: asyncio.Event) -> None:
        model = await self.http.wait_served_model(stop)
        if model is not None:
            self.served_model = model
            self._ready.set()
            log.info("engine_ready", url=self.url, model=self.served_model, state_addr=self.state_addr)

    def _engine_lost(self, why: str) -> None:
        """The engine died or restarted: unavailable at once (jobs are refused and routed elsewhere,
        not accepted to fail with 502 until the state stream goes stale), available again once its
        server answers its model list (a restarted engine publishes state before its HTTP server
        listens)."""
        if self._ready.is_set():
            log.warning("engine_lost", url=self.url, why=why)
        self._ready.clear()
        if self._stop is not None and (self._ready_task is None or self._ready_task.done()):
            self._ready_task = asyncio.get_running_loop().create_task(self._become_ready(self._stop))

    async def run(self, events: EngineEvents, stop: asyncio.Event) -> None:
        """Wait for the server and follow its state stream until ``stop``
        (:func:`~kairos.engines.vllm.subscriber.follow`); every snapshot with a step record is
        reported as a :class:`StepOutput`. The stream's connection closing (the engine process
        died) or a new ``engine_pid`` (it restarted) makes the engine unavailable until its server
        answers again (:meth:`_engine_lost`)."""
        self._events, self._stop = events, stop
        sub = EngineStateSubscriber(self.state_addr)
        self._ready_task = asyncio.ensure_future(self._become_ready(stop))

        async def on_snapshot(snap: Any) -> None:
            if self.snapshot is not None and snap.engine_pid != self.snapshot.engine_pid:
                self._engine_lost(f"engine restarted (pid {self.snapshot.engine_pid} -> {snap.engine_pid})")
            started = self._on_snapshot(snap)
            if snap.step_record is not None:
                await events.on_step(step_output(snap.step_record, self._reqs, started, self.model))
        try:
            await follow(sub, stop, on_snapshot, self._engine_lost,
                         lambda why: log.warning("bad_engine_state", error=why))
        finally:
            self._ready_task.cancel()
            await asyncio.gather(self._ready_task, return_exceptions=True)
            sub.close()
            for r in list(self._reqs.values()):
                if r.task is not None:
                    r.task.cancel()
            await self.http.close()
