"""Kairos inside vLLM: the chunk-schedule scheduler plugin and its engine-state stream.

* :mod:`kairos.engines.vllm.plugin.protocol` — the messages the plugin publishes (msgspec + stdlib only, so the
  node agent can import it without vLLM).
* :mod:`kairos.engines.vllm.subscriber` — an asyncio ZMQ SUB that yields those messages (no vLLM).
* :mod:`kairos.engines.vllm.plugin.scheduler` — ``KairosScheduler`` / ``KairosAsyncScheduler`` (imports vLLM;
  load it in the engine with ``--scheduler-cls kairos.engines.vllm.plugin.scheduler.KairosScheduler``).
* :mod:`kairos.engines.vllm.tiny_model` — a tiny random-weight Llama + word-level tokenizer for tests.

How it fits together: docs/vllm.md.
"""

#: The vLLM version the scheduler plugin is written and tested against (Makefile VLLM_VERSION).
VLLM_VERSION = "0.32.0"
