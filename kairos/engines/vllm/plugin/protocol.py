"""The engine-state stream: what the Kairos scheduler plugin publishes from inside vLLM.

One :class:`EngineSnapshot` per message, encoded with ``msgspec.json`` and sent on a ZMQ PUB
socket that the plugin binds at ``$KAIROS_ENGINE_STATE_ADDR`` (``ipc://…`` or ``tcp://…``).
A message goes out after every engine step (carrying its :class:`StepRecord`), on every
``add_request`` / ``finish_requests``, and at least every :data:`IDLE_PERIOD_S` when idle.

This module imports only msgspec and the standard library (no vLLM, no ZMQ) so the node agent
can decode the stream from its own virtualenv. Times named ``*_unix_ms`` are wall-clock
milliseconds since the epoch of the engine process; durations are ``*_ms``; token counts are
prompt/context tokens of the engine's tokenizer.
"""

from __future__ import annotations

import msgspec

#: Environment variable holding the PUB socket's address (``ipc:///tmp/x.sock``, ``tcp://127.0.0.1:5557``).
STATE_ADDR_ENV = "KAIROS_ENGINE_STATE_ADDR"
#: Longest gap between two messages while the engine is idle (seconds).
IDLE_PERIOD_S = 0.1
#: ``SamplingParams.extra_args`` key with the Kairos request id (contract B).
RID_KEY = "kairos_rid"
#: ``SamplingParams.extra_args`` key with a deflected request's prefill chunks p_1, p_2, … (contract B).
CHUNKS_KEY = "kairos_prefill_chunks"


class WaitingRequest(msgspec.Struct, frozen=True):
    """A request that still has prompt tokens to prefill.

    The snapshot lists them in FIFO order: running-but-still-prefilling requests first, then the
    waiting queue.
    """

    request_id: str  #: the Kairos request id (``extra_args["kairos_rid"]``), else vLLM's request id
    prompt_tokens: int  #: prompt length (tokens)
    remaining_prefill_tokens: int  #: prompt_tokens − num_computed_tokens (after prefix-cache hits)


class DeflectedChunk(msgspec.Struct, frozen=True):
    """The prefill chunk one scheduled request (carrying ``kairos_prefill_chunks``) got in a step."""

    request_id: str  #: Kairos request id, else vLLM's
    chunk_index: int  #: index into the request's ``kairos_prefill_chunks`` (past the end: last entry repeats)
    tokens: int  #: prompt tokens scheduled for it in this step
    #: its ``num_computed_tokens`` before this step (prefix-cache hit + earlier chunks): the ``c`` of the
    #: latency model's ``p·c`` / ``n·c`` terms (kairos/core/model/latency.py); 0 from a plugin that predates the field
    computed_tokens: int = 0


class PrefillChunk(msgspec.Struct, frozen=True):
    """The prompt tokens one scheduled request without a chunk schedule (keep path: a prefill node's
    requests, vLLM's own chunked prefill of long prompts) computed in a step."""

    request_id: str  #: Kairos request id, else vLLM's
    tokens: int  #: prompt tokens scheduled for it in this step
    #: its ``num_computed_tokens`` before this step (prefix-cache hit + earlier chunks): the context the
    #: chunk attends over, the ``c`` of the latency model (kairos/core/model/latency.py)
    computed_tokens: int


class StepRecord(msgspec.Struct, frozen=True):
    """One executed engine step (sent on the snapshot published right after it)."""

    step: int  #: 1-based index of the step in this engine process
    started_unix_ms: float  #: wall clock when ``schedule()`` returned
    wall_ms: float  #: ``schedule()`` return → ``update_from_output()`` entry (the forward pass), ms
    prefill_tokens: int  #: prompt tokens scheduled this step (all requests)
    decode_count: int  #: requests decoding (1 token) this step
    kv_tokens: int  #: K: context tokens of the decoding requests at this step
    cached_tokens: int  #: prefix-cache hit tokens of requests first scheduled this step
    chunks: list[DeflectedChunk]  #: one per request with ``kairos_prefill_chunks`` that prefilled this step
    #: requests scheduled for the first time this step (Kairos request id, else vLLM's): the start of
    #: their prefill, as the simulator's prefill queue ends (empty from a plugin that predates it)
    first_scheduled: list[str] = msgspec.field(default_factory=list)
    #: every other request that prefilled this step (no chunk schedule), with its context; empty from
    #: a plugin that predates the field
    prefills: list[PrefillChunk] = msgspec.field(default_factory=list)


class EngineSnapshot(msgspec.Struct, frozen=True, tag="snapshot"):
    """The engine's scheduling state at one instant (contract A of the Kairos helpers)."""

    seq: int  #: +1 per message from this engine process (starts at 1); gaps = dropped messages
    sent_unix_ms: float  #: wall clock when the message was built
    engine_pid: int  #: pid of the process running the scheduler
    step: int  #: steps executed so far
    batch_size: int  #: B: running requests past their prefill (decoding)
    kv_tokens: int  #: K: sum of num_computed_tokens of those B requests
    waiting: list[WaitingRequest]  #: requests with prompt tokens left, FIFO (see WaitingRequest)
    num_running: int  #: len(scheduler.running)
    num_waiting: int  #: requests in the waiting queues (including skipped/blocked ones)
    kv_cache_usage: float  #: fraction of KV blocks in use, 0..1
    free_kv_tokens: int  #: free KV blocks × block_size
    block_size: int  #: KV cache block size (tokens)
    step_record: StepRecord | None = None  #: set on the message sent right after a step


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(EngineSnapshot)


def encode(snapshot: EngineSnapshot) -> bytes:
    """Serialise a snapshot for the wire (JSON bytes)."""
    return _encoder.encode(snapshot)


def decode(data: bytes) -> EngineSnapshot:
    """Parse one message of the stream.

    Raises :class:`msgspec.ValidationError` (names the offending field) or
    :class:`msgspec.DecodeError` when ``data`` is not a valid snapshot.
    """
    return _decoder.decode(data)
