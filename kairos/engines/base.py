"""The engine-backend contract: what a node agent needs from the engine beside it.

A node agent (:mod:`kairos.services.node_agent`) drives exactly one engine through an
:class:`EngineBackend` and hears from it through :class:`EngineEvents`. Like vLLM's scheduler
interface (``vllm/v1/core/sched/interface.py``) every method below says who calls it, when, and
what comes back; a backend implements the abstract ones and may override the hooks.

The calls, in a request's life on one node (the phases are :class:`kairos.core.vocabulary.RequestPhase`,
the node's part :class:`kairos.core.vocabulary.RequestRole`)::

    prefill node        add_prefill ─▶ (steps) ─▶ on_prefill_done ─▶ handoff_params ─▶ … ─▶ release
    decode node (keep)  add_remote_decode ─▶ take_allocated / on_allocated ─▶ pull_kv ─▶ kv_arrived
                        ─▶ on_tokens … ─▶ on_finished
    decode node (defl.) add_deflected ─▶ (chunk steps) ─▶ on_tokens(first_index=0) … ─▶ on_finished
    any time            abort (cancel, failure) · on_failed (the engine gave up) · state() (heartbeats)

Everything runs on the agent's event loop: the ``add_*``/``kv_arrived``/``release``/``abort`` calls
are synchronous and must not block (queue the work; :meth:`EngineBackend.run` does it), the
:class:`EngineEvents` callbacks are awaited by the backend's own tasks.

Backends: :class:`kairos.engines.emulated.EmulatedBackend` (the engine model in real time, also
the sample implementation) and :class:`kairos.engines.vllm.backend.VllmBackend` (a vLLM server);
:data:`kairos.engines.BACKENDS` names them. ``tests/unit/test_backend_contract.py`` runs the same
conformance checks on each; kairos/engines/README.md says how to add one.
"""

from __future__ import annotations

import abc
import asyncio
from dataclasses import dataclass
from typing import Any, Protocol

from kairos.contracts.errors import ErrorCode
from kairos.contracts.wire import InferenceRequest
from kairos.core.engine_model import EngineState, GroundTruth
from kairos.core.model.latency import LatencyModel
from kairos.core.vocabulary import RequestPhase


@dataclass(frozen=True)
class StepOutput:
    """One executed engine step, backend-neutral.

    The emulated backend fills every field; the vLLM backend builds it from the plugin's
    ``StepRecord`` (``kairos.engines.vllm.plugin.protocol``) and leaves the per-request fields (``tokens``,
    ``first_tokens``, ``prefill_done``, ``finished``) empty: those come from HTTP responses.
    """

    step: int
    started_unix_ms: float
    wall_ms: float  #: measured duration of the step
    predicted_ms: float  #: the latency model's prediction for the step
    batch_size: int
    kv_tokens: int
    prefill_tokens: int
    prefill_chunks: tuple[tuple[str, int, int], ...]  #: (req_id, tokens, cached_before)
    deflected_chunk: tuple[str, int, int, int] | None  #: (req_id, step_index, chi, tokens)
    tokens: tuple[tuple[str, int], ...]  #: (req_id, token_index)
    first_tokens: tuple[str, ...]
    prefill_done: tuple[str, ...]
    finished: tuple[str, ...]
    cached_tokens: int = 0  #: prefix-cache hit tokens of requests first scheduled in this step


class EngineEvents(Protocol):
    """What a backend reports to the agent (the agent implements it; every call is awaited by the
    backend, from :meth:`EngineBackend.run` or a task of its own, on the agent's event loop).

    * ``on_step(out)``: an engine step executed (in step order).
    * ``on_allocated(rids)``: remote decodes whose KV blocks were allocated (the agent starts their
      transfer: :meth:`EngineBackend.pull_kv`).
    * ``on_prefill_done(rid)``: keep path, prefill node: the prompt is computed, its KV held here.
    * ``on_tokens(rid, first_index, count, text, finish_reason)``: ``count`` output tokens from index
      ``first_index`` (0 = the first token: TTFT ends) with their text; indexes of one request
      arrive in order, without gaps. ``finish_reason`` (``stop``/``length``/``abort``) when these
      are the request's last tokens and the engine knows it already (vLLM's last delta carries
      it), else None; ``on_finished`` follows either way. A backend that sets it lets the client's
      stream end as vLLM's does: the finish reason on the last token's chunk. ``logprobs``: one
      :class:`~kairos.contracts.events.TokenLogprob` per token when the request asked for them
      (``SamplingParams.logprobs``) and the engine gives them (vLLM), else None. ``stop_reason``: with
      ``finish_reason``, the stop string or stop token id that ended the request (vLLM's
      ``CompletionOutput.stop_reason``), else None (EOS, length, or not the last tokens).
      ``token_ids``: the ``count`` tokens' ids when the engine gives them (a migrated request
      resumes from them, ``InferenceRequest.resume``), else None.
    * ``on_finished(rid, finish_reason, cached_tokens, stop_reason)``: last token emitted (``stop``/
      ``length``/``abort``); ``cached_tokens`` prompt tokens were served from the prefix cache;
      ``stop_reason`` as for ``on_tokens`` (None unless a stop string or id ended it). Nothing of
      ``rid`` follows.
    * ``on_failed(rid, status, code, message)``: the engine could not serve ``rid`` (``code`` from
      the error catalogue, ``status`` the HTTP status the client gets). Nothing of ``rid`` follows.
    """

    async def on_step(self, out: StepOutput) -> None: ...

    async def on_allocated(self, rids: list[str]) -> None: ...

    async def on_prefill_done(self, rid: str) -> None: ...

    async def on_tokens(self, rid: str, first_index: int, count: int, text: str,
                        finish_reason: str | None = None, logprobs: list | None = None,
                        stop_reason: str | int | None = None, token_ids: list[int] | None = None) -> None: ...

    async def on_finished(self, rid: str, finish_reason: str, cached_tokens: int,
                          stop_reason: str | int | None = None) -> None: ...

    async def on_failed(self, rid: str, status: int, code: ErrorCode, message: str) -> None: ...


class EngineBackend(abc.ABC):
    """One engine as the node agent sees it (the module docstring has the call order).

    A refusal is a :class:`ValueError` (the engine model's ``EngineError``, vLLM's
    ``EngineApiError``): the ``add_*`` calls raise it when the engine cannot take the request, and
    the agent then refuses the job or the handoff (``engine_refused: <message>``) with nothing
    left behind on the engine.
    """

    #: False while the engine cannot take work (the agent then reports ``accepting=False``)
    available: bool = True

    @classmethod
    @abc.abstractmethod
    def from_config(cls, cfg: Any, model: LatencyModel, truth: GroundTruth | None = None) -> "EngineBackend":
        """Called by :func:`kairos.engines.make_backend` when the agent is built (before its loop
        runs). ``cfg``: the :class:`~kairos.services.node_agent.config.AgentConfig`; ``model``: the
        latency profile the node believes (``StepOutput.predicted_ms``); ``truth``: an emulated
        engine's real step times (a real engine has its own: ignore it).

        Raises:
            ConfigError: a setting the backend needs is missing or unreadable."""

    async def confirm_available(self, timeout_s: float) -> bool:
        """Called by the agent when :attr:`available` alone would refuse a job or a handoff: may the
        engine take a request now? ``timeout_s``: the longest this may wait (s). An engine whose
        state is late but which still answers is slow, not dead (issue 10); a backend that can ask
        its engine directly overrides this. Default: :attr:`available`."""
        return self.available

    @abc.abstractmethod
    def add_prefill(self, req: InferenceRequest) -> None:
        """Keep path, prefill node. Called by the agent once it accepts the job: compute
        ``req``'s prompt, then report :meth:`EngineEvents.on_prefill_done` and hold its KV (phase
        ``held``) until :meth:`release` or :meth:`abort`. No output token is reported.

        Raises:
            ValueError: the engine refuses the request (nothing of it stays)."""

    @abc.abstractmethod
    def add_remote_decode(self, req: InferenceRequest, kv_transfer_params: dict[str, Any] | None = None) -> None:
        """Keep path, decode node. Called by the agent when it accepts a KV handoff: decode ``req``
        with the KV computed on the prefill node (``kv_transfer_params``: the prefill engine's
        handle, :meth:`handoff_params` there). The request waits for blocks, is listed by
        :meth:`take_allocated` once it has them (phase ``awaiting_kv``), decodes after
        :meth:`kv_arrived`, then reports tokens and finishes.

        Raises:
            ValueError: the engine refuses the request (nothing of it stays)."""

    @abc.abstractmethod
    def add_deflected(self, req: InferenceRequest, chunk_schedule: list[int], decision_batch_size: int = 0) -> None:
        """Deflect path, decode node. Called by the agent once it accepts the job: chunked
        prefill along ``chunk_schedule`` (χ per step: total step tokens including the B decodes the
        decision assumed, ``decision_batch_size``; phase ``deflected_prefill``), each chunk reported
        in ``StepOutput.deflected_chunk``; the first token ends the prefill, decoding follows.

        Raises:
            ValueError: the engine refuses the request (nothing of it stays)."""

    @abc.abstractmethod
    def kv_arrived(self, req_id: str) -> None:
        """Called by the agent when :meth:`pull_kv` returned and the request is still
        ``awaiting_kv``: it becomes a running decode. Unknown ids are ignored."""

    @abc.abstractmethod
    def release(self, req_id: str) -> None:
        """Prefill node. Called by the agent when the decode node says it pulled the KV (or the hold
        expired): free the blocks of a ``held`` request. Only for a request in phase ``held``."""

    @abc.abstractmethod
    def abort(self, req_id: str) -> bool:
        """Called by the agent on a cancel or when it gives a request up: remove ``req_id`` in any
        phase and free its blocks; no event of it follows. Returns whether it was running here
        (False for an unknown or finished id: idempotent)."""

    @abc.abstractmethod
    def take_allocated(self) -> list[str]:
        """Called by the agent right after :meth:`add_remote_decode`: the remote decodes whose KV
        blocks were allocated since the last call (or :meth:`EngineEvents.on_allocated`, whichever
        reports them first: each id once). The agent starts their transfer."""

    @abc.abstractmethod
    def phase(self, req_id: str) -> RequestPhase | None:
        """Called by the agent before it releases, frees or marks the KV arrived: where ``req_id`` is
        on the engine (``held``, ``awaiting_kv``, …), None when unknown or gone."""

    @abc.abstractmethod
    async def pull_kv(self, src_node: str, req_id: str, kv_tokens: int) -> float:
        """Called by the agent (a task per request) for every id :meth:`take_allocated` or
        :meth:`EngineEvents.on_allocated` gave it: wait until ``req_id``'s KV cache from
        ``src_node`` is in the blocks allocated here. Returns the transfer time in ms, including
        waiting for the link; returns early (the phase is then no longer ``awaiting_kv``) when the
        request was aborted meanwhile."""

    @abc.abstractmethod
    def state(self) -> EngineState:
        """Called by the agent for every heartbeat (every ``state_period_ms``) and job check: B, K,
        the prefill queue, deflections in flight, free KV (the dispatcher routes on it)."""

    def handoff_params(self, req_id: str) -> dict[str, Any] | None:
        """Prefill node. Called by the agent when it hands the KV of a ``held`` request to a decode
        node: what that node's engine needs to pull it (vLLM's ``kv_transfer_params``), None for
        engines that need nothing."""
        return None

    def kv_transfer_ms(self, kv_tokens: int) -> float:
        """Called by the agent at a handoff: the expected transfer time of ``kv_tokens`` (ms), the
        heartbeat's ``kv_backlog_ms``; 0 when the backend cannot tell."""
        return 0.0

    def set_tbt_guard_ms(self, ms: float | None) -> None:
        """Called by the agent every heartbeat under kairos+ (the node's learned correction):
        tighten/relax the node-side chunk guard. A backend without a guard ignores it."""

    def note_block_hashes(self, req_id: str, block_hashes: list[int], block_tokens: int) -> None:
        """Called by the agent just before ``add_*`` of ``req_id``: the prompt's prefix-cache block
        hashes (``InferenceRequest.block_hashes``). A backend whose engine hashes prompts itself
        (vLLM) ignores them."""

    def cache_events(self, full: bool) -> tuple[int, list[int], list[int], bool] | None:
        """Called by the agent for every heartbeat: ``(block_tokens, stored, removed, is_full)``
        prefix-cache block hashes since the last call (net), or — with ``full``, or when the net
        change exceeds ``kairos.contracts.wire.CACHE_SYNC_MAX_HASHES`` — the cache itself as
        ``stored`` (at most that many hashes, the most recently used: ``is_full`` True); None: this
        backend reports no cache.

        Hook for the vLLM backend (not implemented there): start vLLM with
        ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": ...}'``,
        subscribe to its ZMQ feed (``vllm/distributed/kv_events.py``: ``KVEventBatch`` of
        ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size)`` /
        ``BlockRemoved(block_hashes)`` / ``AllBlocksCleared``) and return the hashes accumulated
        since the previous call. The dispatcher's index (kairos/core/cluster/prefix_index.py) must then match them with
        request hashes computed the same way as vLLM's (``hash_block_tokens`` over token ids, with
        the same ``PYTHONHASHSEED``/sha256 setting), i.e. the ingress must hash token ids like vLLM.
        """
        return None

    @abc.abstractmethod
    async def run(self, events: EngineEvents, stop: asyncio.Event) -> None:
        """Called by the agent once, as a task, when it starts: drive the engine until ``stop`` is
        set, reporting to ``events`` (steps in order; each request's tokens in order, then exactly
        one ``on_finished`` or ``on_failed``). Returns after ``stop``; cancelled at a crash."""
