"""``kairos profile --vllm``'s co-load: the testbed's other engine kept busy with prefills while
one node is profiled.

On the CPU testbed of ``kairos up --engine vllm`` (1P1D: ``prefill-0``'s server on core 0,
``decode-0``'s on core 1, :func:`kairos.cli.up.plan`) both engines compute at the same time: the prefill
engine is the bottleneck and runs back-to-back 1,024-token steps while the decode engine runs its
decodes and deflected chunks. Two cores computing at once run slower than one alone (shared L3
cache, memory bandwidth and clock), and a profile measured beside an idle core under-predicts every
compute-heavy step of the live stack: the steps with a prefill chunk most (the live step records
of the demo show it per step kind; docs/calibration.md). So ``kairos profile --vllm`` starts the
second engine where ``kairos up`` puts ``prefill-0`` and keeps it prefilling — a queue of
``concurrency`` requests of random token ids (no prefix-cache hits), prompt lengths uniform in
[``min_prompt_tokens``, ``max_prompt_tokens``], one output token each (vLLM's own
``/v1/completions``: nothing of Kairos on this path) — for as long as the profile runs.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from typing import Any

import numpy as np


class CoLoad:
    """Back-to-back prefills on one vLLM server, from ``concurrency`` client threads.

    Args:
        url: the server's base URL (``http://127.0.0.1:<port>``).
        headers: extra request headers (the server's ``Authorization``).
        served_model: the model name the server serves.
        vocab_size: the model's vocabulary (token ids are drawn from [3, vocab_size)).
        min_prompt_tokens, max_prompt_tokens: prompt length range (tokens, inclusive).
        concurrency: requests kept in flight (≥ 2 keeps the engine's queue non-empty between requests).
        seed: the prompts' random seed.

    Raises:
        ValueError: an empty length range, ``concurrency`` < 1 or a vocabulary of ≤ 3 tokens.
    """

    def __init__(self, url: str, headers: dict[str, str], served_model: str, vocab_size: int,
                 min_prompt_tokens: int, max_prompt_tokens: int, concurrency: int = 2, seed: int = 0) -> None:
        if not 1 <= min_prompt_tokens <= max_prompt_tokens:
            raise ValueError(f"prompt lengths [{min_prompt_tokens}, {max_prompt_tokens}]: need 1 ≤ min ≤ max")
        if concurrency < 1 or vocab_size <= 3:
            raise ValueError(f"concurrency {concurrency} (≥ 1) and vocab_size {vocab_size} (> 3)")
        self.url, self.headers, self.served_model = url, headers, served_model
        self.vocab_size, self.lengths = vocab_size, (min_prompt_tokens, max_prompt_tokens)
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, name=f"co-load-{i}", daemon=True)
                         for i in range(concurrency)]
        self.requests = self.prompt_tokens = self.errors = 0
        self.last_error: str | None = None
        self._started = self._stopped = 0.0

    def _prompt(self) -> list[int]:
        with self._lock:  # numpy Generators are not thread-safe
            n = int(self._rng.integers(self.lengths[0], self.lengths[1] + 1))
            return self._rng.integers(3, self.vocab_size, size=n).tolist()

    def _loop(self) -> None:
        while not self._stop.is_set():
            prompt = self._prompt()
            body = json.dumps({"model": self.served_model, "prompt": prompt, "max_tokens": 1}).encode()
            req = urllib.request.Request(f"{self.url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json", **self.headers})
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    r.read()
            except (OSError, ValueError) as exc:
                with self._lock:
                    self.errors += 1
                    self.last_error = repr(exc)
                self._stop.wait(0.5)  # a server that refuses is not hammered
                continue
            with self._lock:
                self.requests += 1
                self.prompt_tokens += len(prompt)

    def start(self) -> CoLoad:
        """Start the client threads; returns self."""
        self._started = time.monotonic()
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> dict[str, Any]:
        """Stop (each thread finishes its request in flight, bounded by the request timeout) and
        return what ran: ``{requests, prompt_tokens, errors, seconds, prompt_tokens_per_s, ...}``."""
        if not self._stopped:
            self._stop.set()
            for t in self._threads:
                t.join(timeout=130)
            self._stopped = time.monotonic()
        secs = max(self._stopped - self._started, 1e-9) if self._started else 0.0
        return {"requests": self.requests, "prompt_tokens": self.prompt_tokens, "errors": self.errors,
                "last_error": self.last_error, "seconds": round(secs, 1),
                "prompt_tokens_per_s": round(self.prompt_tokens / secs, 1) if secs else 0.0,
                "prompt_lengths": list(self.lengths), "concurrency": len(self._threads)}
