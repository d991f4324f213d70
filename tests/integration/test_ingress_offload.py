"""A long prompt is tokenized off the ingress's event loop (kairos/services/ingress/completions.py,
``OFFLOAD_BODY_BYTES``; tokenize.py), with the GIL released while the tokenizer works
(openai_api/prompt.py ``encode_ids``), so the other streams of the replica keep flowing.

Found by a fresh-user try: a 3.6 MB completion body (``'hello ' * 600000``, a tokenizer configured)
froze another stream for 1.71 s before its 400 ``context_length_exceeded``; ``POST /tokenize`` for
3.6 MB, 0.55 s. The whole stack runs in this test's one event loop, so a tokenization on the loop
stops the stream below. The assertions are about structure, not wall time: while the big prompt
is counted the loop delivers further chunks of the in-flight stream (a gate makes the counting wait
for them: on the loop it would wait for itself), and while the real tokenizer encodes it in its
worker thread, chunks keep arriving (a tokenizer holding the GIL lets none through).
"""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from kairos.engines.vllm.tiny_model import write_tokenizer_files
from tests.integration.conftest import stack

pytestmark = pytest.mark.integration

MODEL = "kairos-emulated"
BIG = "hello " * 600_000  #: 3.6 MB, the reported body (``POST /tokenize``: no bus limit there)
#: a completion prompt under the bus's 1 MiB message limit (a bigger one is refused before it is
#: counted, test_ingress_bus_limit.py) and over the context whatever it tokenizes to: 420 kB
BIG_PROMPT = "hello " * 70_000
LONG_TEXT = 300_000  #: characters from which the gate holds a tokenization
GATE_CHUNKS = 3  #: chunks the stream must deliver while the big prompt is being counted


class Gate:
    """Wraps a tokenizing callable: on a text of :data:`LONG_TEXT` characters or more it records its thread, waits (in that
    thread) until the stream delivered :data:`GATE_CHUNKS` more chunks, then runs the real tokenizer
    and records how many chunks arrived meanwhile."""

    def __init__(self, real, chunks: list[int]) -> None:
        self.real, self.chunks = real, chunks
        self.thread: int | None = None
        self.started = threading.Event()
        self.seen = threading.Event()
        self.at_start = 0
        self.during_encode: int | None = None

    def __call__(self, text: str, *args, **kwargs):
        if len(text) < LONG_TEXT:
            return self.real(text, *args, **kwargs)
        self.thread = threading.get_ident()
        self.at_start = self.chunks[0]
        self.started.set()
        self.seen.wait(20)  # never set when this runs on the event loop: that loop is the one blocked here
        before = self.chunks[0]
        out = self.real(text, *args, **kwargs)
        self.during_encode = self.chunks[0] - before
        return out

    def note_chunk(self) -> None:
        if self.started.is_set() and self.chunks[0] - self.at_start >= GATE_CHUNKS:
            self.seen.set()


async def stream_while(st, gate: Gate, chunks: list[int], big_call) -> tuple[int, dict]:
    """Runs ``big_call`` while a long stream is being read; (its status, its body)."""
    body = {"model": MODEL, "prompt": "tell me a long story", "max_tokens": 30000, "stream": True}
    first = asyncio.Event()

    async def read() -> None:
        async with st.http.post(st.base + "/v1/completions", json=body) as r:
            assert r.status == 200
            async for line in r.content:
                if line.startswith(b"data: {"):
                    chunks[0] += 1
                    first.set()
                    gate.note_chunk()
                    if gate.during_encode is not None:
                        return  # done: closing the stream cancels the request

    reader = asyncio.ensure_future(read())
    await first.wait()
    try:
        return await big_call()
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)


async def test_a_long_prompt_is_tokenized_off_the_event_loop(nats_url, tmp_path):
    tok = write_tokenizer_files(tmp_path) / "tokenizer.json"
    async with stack(nats_url, ingress_overrides={"tokenizer_path": str(tok)}) as st:
        loop_thread = threading.get_ident()

        # POST /v1/completions: a long prompt under the bus limit, its count gated
        chunks = [0]
        gate = Gate(st.ingress.completions.counter, chunks)
        st.ingress.completions.counter = gate

        async def complete():
            async with st.http.post(st.base + "/v1/completions",
                                    json={"model": MODEL, "prompt": BIG_PROMPT, "max_tokens": 2}) as r:
                return r.status, await r.json()

        status, out = await stream_while(st, gate, chunks, complete)
        assert status == 400 and out["error"]["code"] == "context_length_exceeded", out
        assert gate.thread is not None and gate.thread != loop_thread, "the prompt was counted on the event loop"
        assert gate.seen.is_set(), "the stream delivered no chunk while the prompt was being counted"
        assert gate.during_encode is not None and gate.during_encode >= GATE_CHUNKS, \
            f"{gate.during_encode} chunks while the tokenizer encoded 420 kB: it held the GIL"

        # POST /tokenize: the same
        chunks = [0]
        tokz = st.ingress.tokenization.tok
        gate = Gate(tokz.encode, chunks)
        tokz.encode = gate

        async def tokenize():
            async with st.http.post(st.base + "/tokenize", json={"model": MODEL, "prompt": BIG}) as r:
                return r.status, json.loads(await r.read())

        status, out = await stream_while(st, gate, chunks, tokenize)
        assert status == 200 and out["count"] == 600_000, {k: out.get(k) for k in ("count", "error")}
        assert gate.thread is not None and gate.thread != loop_thread, "/tokenize tokenized on the event loop"
        assert gate.seen.is_set() and gate.during_encode is not None and gate.during_encode >= GATE_CHUNKS
