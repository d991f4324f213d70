"""OpenAI-compatible request parsing, prompt token counting and response bodies (no I/O).

Where data comes from: the JSON bodies of ``POST /v1/completions`` and ``POST
/v1/chat/completions``. Where it goes: a :class:`ParsedRequest` the ingress turns into a
:class:`~kairos.contracts.wire.InferenceRequest`, and the response/SSE bodies built here.

Prompt token counting:

* token-id prompts (``prompt: [1, 2, 3]`` or ``[[1, 2, 3]]``) are exact: the number of ids;
* text with a configured tokenizer (HF ``tokenizers``, a local ``tokenizer.json``): the
  tokenizer's count — with its special tokens (BOS…) for a completion prompt, without for a
  rendered chat prompt, as vLLM tokenizes them;
* text without a tokenizer: the **estimate** ``ceil(utf-8 bytes / 4)`` (OpenAI's rule of thumb of
  ~4 characters per token for English), at least 1. Flagged ``prompt_tokens_exact=False``.

Chat messages are rendered into one prompt text before counting: with the served model's chat
template when its directory (beside ``tokenizer.json``) has one (:func:`load_chat_template`), else
with this fixed template::

    <|{role}|>\\n{content}\\n   (per message)   then   <|assistant|>\\n

An assistant message's ``tool_calls`` add one line each, ``<tool_call>{"name": …, "arguments":
…}</tool_call>\\n``, after its content, so their arguments are counted (``tools`` themselves are
refused: Kairos' path does not parse tool calls out of the output).

Parameters: :data:`PARAMETERS` lists every parameter Kairos knows and whether it is honoured
(validated as vLLM 0.32's OpenAI server does, carried on the bus in
:class:`~kairos.contracts.wire.SamplingParams`) or refused with a 400 naming it; any other parameter is a
400 too. The README's parameter table is :func:`parameter_table_markdown`.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Literal

from kairos.core.engine.text import EMULATED_VOCAB_SIZE
from kairos.contracts.wire import SamplingParams

Endpoint = Literal["completions", "chat"]


class ApiError(Exception):
    """An OpenAI-shaped error: HTTP ``status`` plus the ``error`` object fields."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        """``{"error": {...}}`` as OpenAI returns it."""
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_type_for(status: int) -> str:
    """OpenAI error ``type`` for an HTTP status."""
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error" if status != 503 else "service_unavailable"
    return "invalid_request_error"


@dataclass(frozen=True)
class ParsedRequest:
    """A validated completion request."""

    endpoint: Endpoint
    model: str
    prompt_text: str | None  #: the prompt (chat: rendered) or None for token ids
    prompt_token_ids: list[int] | None
    max_tokens: int | None  #: None until :func:`resolve_max_tokens` (chat without max_tokens)
    stream: bool
    include_usage: bool  #: stream_options.include_usage
    sampling: SamplingParams = SamplingParams()
    max_tokens_explicit: bool = True  #: the client set max_tokens (else it is the endpoint's default)


#: ``counter(text, add_special_tokens=False) -> tokens`` (see :func:`load_tokenizer`)
TokenCounter = Callable[..., int]
#: Renders validated chat messages (dicts with role, content, optional tool_calls…) into prompt text.
ChatTemplate = Callable[[list[dict[str, Any]]], str]


def estimate_tokens(text: str) -> int:
    """The documented estimate: ceil(utf-8 bytes / 4), at least 1."""
    return max(1, math.ceil(len(text.encode("utf-8")) / 4))


def load_tokenizer(path: str) -> tuple[TokenCounter, int]:
    """(counter, vocabulary size incl. added tokens) of the HF ``tokenizers`` tokenizer in the local
    ``tokenizer.json`` at ``path``. ``counter(text, add_special_tokens)``: as vLLM tokenizes, a
    completion's text prompt with the tokenizer's special tokens (e.g. BOS, from its post-processor),
    a rendered chat prompt without (the template holds them).

    Raises:
        ValueError: the file cannot be loaded.
    """
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(path)
    except Exception as exc:  # tokenizers raises plain Exception subclasses
        raise ValueError(f"cannot load tokenizer {path!r}: {exc}") from None
    def count(text: str, add_special_tokens: bool = False) -> int:
        return max(1, len(tok.encode(text, add_special_tokens=add_special_tokens).ids))

    return count, tok.get_vocab_size(True)


def tokenizer_counter(path: str) -> TokenCounter:
    """The counter of :func:`load_tokenizer`.

    Raises:
        ValueError: the file cannot be loaded.
    """
    return load_tokenizer(path)[0]


def load_chat_template(model_dir: str) -> ChatTemplate | None:
    """The served model's chat template, from ``model_dir`` (the directory of its ``tokenizer.json``):
    ``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of
    ``{name, template}`` of which ``default`` is used). None when the model has none (the fixed
    template of the module docstring is used then).

    Rendered as Hugging Face ``transformers`` renders chat templates (``_compile_jinja_template``:
    jinja2 ``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)``, ``tojson``,
    ``raise_exception``, ``strftime_now``) with ``messages``, ``add_generation_prompt=True``,
    ``tools=None`` and the special tokens of ``tokenizer_config.json`` (``bos_token``, ``eos_token``…);
    assistant ``tool_calls`` arguments are parsed from their JSON strings into objects first, as
    vLLM's chat preprocessing does, so templates can ``tojson`` them.

    Raises:
        ValueError: a template file or ``tokenizer_config.json`` exists but cannot be read or compiled.
    """
    import os
    from datetime import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    cfg: dict[str, Any] = {}
    cfg_path = os.path.join(model_dir, "tokenizer_config.json")
    try:
        if os.path.exists(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
        source = cfg.get("chat_template")
        jinja_path = os.path.join(model_dir, "chat_template.jinja")
        if os.path.exists(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                source = f.read()
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the chat template in {model_dir!r}: {exc}") from None
    if isinstance(source, list):
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(source, str) or not source:
        return None

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        template = env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ValueError(f"cannot compile the chat template in {model_dir!r}: {exc}") from None
    special = {k: (v.get("content") if isinstance(v, dict) else v) for k, v in cfg.items()
               if k.endswith("_token") and isinstance(v, (str, dict))}

    def render(messages: list[dict[str, Any]]) -> str:
        msgs = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                calls = []
                for c in m["tool_calls"]:
                    try:
                        args = json.loads(c["function"]["arguments"] or "{}")
                    except ValueError:
                        args = c["function"]["arguments"]
                    calls.append({**c, "function": {**c["function"], "arguments": args}})
                m["tool_calls"] = calls
            msgs.append(m)
        try:
            return template.render(messages=msgs, add_generation_prompt=True, tools=None, documents=None,
                                   **special)
        except jinja2.TemplateError as exc:
            raise ApiError(400, f"the model's chat template rejected the messages: {exc}", param="messages",
                           code="invalid_value") from None
        except Exception as exc:  # a template error on this input (TypeError, KeyError…), not ours
            raise ApiError(400, f"the model's chat template cannot render the messages: {exc!r}",
                           param="messages", code="invalid_value") from None

    return render


def render_chat(messages: list[dict[str, Any]]) -> str:
    """The module docstring's fixed chat template (tool calls included)."""
    parts = []
    for m in messages:
        parts.append(f"<|{m['role']}|>\n{m['content']}\n")
        for c in m.get("tool_calls") or ():
            call = json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                              ensure_ascii=False)
            parts.append(f"<tool_call>{call}</tool_call>\n")
    return "".join(parts) + "<|assistant|>\n"


#: Largest integer accepted in an integer field (int32, as the engines use); above it: out of range.
MAX_INT_FIELD = 2**31 - 1
#: ``seed`` range (vLLM: ``Field(ge=-2**63, le=2**63 - 1)``, vllm/entrypoints/openai/completion/protocol.py).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1

#: The fields a chat message may carry (OpenAI's message objects); anything else is refused.
CHAT_MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})

#: Chat roles accepted in ``messages[].role``.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

Support = Literal["honoured", "refused", "accepted"]


@dataclass(frozen=True)
class Param:
    """One request parameter and what Kairos does with it (the README table is generated from these).

    ``support``: ``honoured`` — validated, carried on the bus (:class:`~kairos.contracts.wire.SamplingParams`
    or :class:`~kairos.contracts.wire.InferenceRequest`) and applied by the engine (vLLM, and the emulated
    engine as ``how`` says); ``refused`` — any value other than ``allowed`` is a 400 naming it;
    ``accepted`` — validated, not used for generation (metadata). ``example``: a valid non-default
    value; ``bad``: a value that is refused (both used by the tests that tie this table to the code).
    """

    name: str
    endpoints: Literal["both", "completions", "chat"]
    support: Support
    how: str
    example: Any = None
    bad: Any = None
    allowed: tuple = (None,)


#: Every request parameter Kairos knows. A parameter not listed here is a 400 ``unknown_parameter``.
PARAMETERS: tuple[Param, ...] = (
    Param("model", "both", "honoured", "must be the served model (404 otherwise)", example=None),
    Param("prompt", "completions", "honoured", "a string or token ids (< vocabulary size); one prompt per request",
          example=[1, 2, 3], bad=[[1], [2]]),
    Param("messages", "chat", "honoured", "roles system/developer/user/assistant/tool, text content; assistant "
          "`tool_calls` and tool results are rendered into the prompt and counted",
          example=[{"role": "user", "content": "hi"}], bad=[]),
    Param("max_tokens", "both", "honoured", "output limit (→ `finish_reason: length`); prompt + max_tokens ≤ "
          "max_model_len. Default: 16 (completions), the remaining context (chat)", example=5, bad=0),
    Param("max_completion_tokens", "chat", "honoured", "as `max_tokens` (takes precedence)", example=5, bad=0),
    Param("stream", "both", "honoured", "SSE chunks; a JSON boolean", example=True, bad="true"),
    Param("stream_options", "both", "honoured", "only with `stream: true`; `include_usage` (JSON boolean) adds the "
          "usage chunk; `continuous_usage_stats: true` is refused", example={"include_usage": True},
          bad={"include_usage": "false"}),
    Param("n", "both", "honoured", "1 only (400 otherwise)", example=1, bad=2),
    Param("temperature", "both", "honoured", "[0, 2]; vLLM samples with it; emulated: 0 makes the output depend "
          "on the prompt only", example=0.5, bad=3),
    Param("top_p", "both", "honoured", "(0, 1]; passed to vLLM (no effect on emulated text)", example=0.9, bad=0),
    Param("top_k", "both", "honoured", "integer ≥ -1 (0 or -1: off); passed to vLLM", example=5, bad=-2),
    Param("min_p", "both", "honoured", "[0, 1]; passed to vLLM", example=0.1, bad=1.5),
    Param("seed", "both", "honoured", "64-bit integer; emulated: the output is a function of (seed, index), "
          "without a seed of the prompt; vLLM-CPU engines (`kairos up --engine vllm`): only with temperature 0, "
          "else 400 (it would kill the engine)", example=42, bad="7"),
    Param("stop", "both", "honoured", "string or list of non-empty strings; text is cut before the match "
          "(`finish_reason: stop`)", example=["\n"], bad=[""]),
    Param("stop_token_ids", "both", "honoured", "token ids < vocabulary size; `finish_reason: stop`",
          example=[7], bad=[10**12]),
    Param("min_tokens", "both", "honoured", "≤ max_tokens; EOS, stop ids and stop strings do not end the output "
          "before it", example=2, bad=-1),
    Param("ignore_eos", "both", "honoured", "JSON boolean; emulated EOS: see the emulated engine notes",
          example=True, bad=1),
    Param("logit_bias", "both", "honoured", "{token id: bias}, ids < vocabulary size, bias clamped to [-100, 100] "
          "(as vLLM); emulated: −100 bans the id", example={"7": -100}, bad={"x": 1}),
    Param("presence_penalty", "both", "honoured", "[-2, 2]; passed to vLLM", example=0.5, bad=3),
    Param("frequency_penalty", "both", "honoured", "[-2, 2]; passed to vLLM", example=0.5, bad=3),
    Param("repetition_penalty", "both", "honoured", "> 0; passed to vLLM", example=1.1, bad=0),
    Param("include_stop_str_in_output", "both", "honoured", "JSON boolean; keep the stop string / stop token text",
          example=True, bad="yes"),
    Param("skip_special_tokens", "both", "honoured", "JSON boolean; emulated: EOS shows as `</s>` when false",
          example=False, bad="no"),
    Param("user", "both", "accepted", "a string; not used for generation", example="u", bad=1),
    Param("echo", "completions", "refused", "only false", example=False, bad=True, allowed=(None, False)),
    Param("logprobs", "both", "refused", "not carried back from the engine: only null (chat: false)", bad=1,
          allowed=(None, False)),
    Param("top_logprobs", "chat", "refused", "only null or 0", bad=2, allowed=(None, 0)),
    Param("best_of", "completions", "refused", "only 1", example=1, bad=2, allowed=(None, 1)),
    Param("suffix", "completions", "refused", "only null", bad="x"),
    Param("response_format", "both", "refused", "only `{\"type\": \"text\"}` (no structured output)",
          example={"type": "text"}, bad={"type": "json_object"}, allowed=(None, {"type": "text"})),
    Param("tools", "chat", "refused", "no tool-call parsing on Kairos' path: only null or []", example=[],
          bad=[{"type": "function", "function": {"name": "f"}}], allowed=(None, [])),
    Param("tool_choice", "chat", "refused", "only null or \"none\"", example="none", bad="auto",
          allowed=(None, "none")),
    Param("parallel_tool_calls", "chat", "refused", "only null (no tools)", bad=True),
    Param("functions", "chat", "refused", "only null (deprecated tools)", bad=[{"name": "f"}]),
    Param("function_call", "chat", "refused", "only null or \"none\"", bad="auto", allowed=(None, "none")),
    Param("modalities", "chat", "refused", "only [\"text\"]", example=["text"], bad=["audio"],
          allowed=(None, ["text"])),
    Param("audio", "chat", "refused", "only null", bad={"voice": "x"}),
    Param("prediction", "chat", "refused", "only null", bad={"type": "content", "content": "x"}),
    Param("store", "chat", "refused", "only null or false", example=False, bad=True, allowed=(None, False)),
    Param("metadata", "chat", "refused", "only null (stored completions)", bad={"k": "v"}),
    Param("service_tier", "chat", "refused", "only null, \"auto\" or \"default\"", example="auto", bad="flex",
          allowed=(None, "auto", "default")),
    Param("reasoning_effort", "chat", "refused", "only null", bad="low"),
    Param("web_search_options", "chat", "refused", "only null", bad={}),
    Param("use_beam_search", "both", "refused", "only false (vLLM extension)", example=False, bad=True,
          allowed=(None, False)),
    Param("allowed_token_ids", "both", "refused", "only null (vLLM extension)", bad=[1]),
    Param("bad_words", "both", "refused", "only null or [] (vLLM extension)", bad=["x"], allowed=(None, [])),
    Param("prompt_logprobs", "both", "refused", "only null (vLLM extension)", bad=1),
    Param("truncate_prompt_tokens", "both", "refused", "only null (vLLM extension)", bad=10),
    Param("structured_outputs", "both", "refused", "only null (vLLM extension)", bad={"regex": "a"}),
    Param("priority", "both", "refused", "only 0 (vLLM extension)", example=0, bad=1, allowed=(None, 0)),
    Param("cache_salt", "both", "refused", "only null (vLLM extension; the node agents may set it)", bad="s"),
    Param("kv_transfer_params", "both", "refused", "only null (set by Kairos' node agents)", bad={}),
    Param("vllm_xargs", "both", "refused", "only null (set by Kairos' node agents)", bad={}),
    Param("chat_template", "chat", "refused", "only null (the served model's template is used)", bad="{{x}}"),
    Param("chat_template_kwargs", "chat", "refused", "only null", bad={"x": 1}),
    Param("add_generation_prompt", "chat", "refused", "only true", example=True, bad=False, allowed=(None, True)),
    Param("continue_final_message", "chat", "refused", "only false", example=False, bad=True,
          allowed=(None, False)),
)

_BY_NAME: dict[str, dict[str, Param]] = {"completions": {}, "chat": {}}
for _p in PARAMETERS:
    for _e in (("completions", "chat") if _p.endpoints == "both" else (_p.endpoints,)):
        _BY_NAME[_e][_p.name] = _p


def parameters(endpoint: Endpoint) -> dict[str, Param]:
    """The :data:`PARAMETERS` of one endpoint, by name."""
    return _BY_NAME[endpoint]


def parameter_table_markdown() -> str:
    """The README's table of supported OpenAI parameters, generated from :data:`PARAMETERS`."""
    ep = {"both": "both", "completions": "completions", "chat": "chat"}
    rows = ["| parameter | endpoint | support | what Kairos does |", "|---|---|---|---|"]
    for p in PARAMETERS:
        rows.append(f"| `{p.name}` | {ep[p.endpoints]} | {p.support} | {p.how} |")
    return "\n".join(rows) + "\n"


def _same(a: Any, b: Any) -> bool:
    """JSON equality that tells booleans from numbers (``0 != False``, ``1 != True``)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int_field(body: dict, name: str, default: int | None, lo: int, hi: int = MAX_INT_FIELD) -> int | None:
    v = body.get(name, default)
    if v is None:
        return default
    if _is_number(v) and (v > hi or v < min(lo, -MAX_INT_FIELD - 1)):  # also 1e26 (a JSON float)
        raise ApiError(400, f"'{name}' is out of range: {v:g} is above the maximum {hi}"
                       if v > 0 else f"'{name}' is out of range: {v:g}", param=name, code="invalid_value")
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"'{name}' must be an integer, got {_show(v)}", param=name, code="invalid_type")
    if v < lo:
        raise ApiError(400, f"'{name}' must be >= {lo}, got {v}", param=name, code="invalid_value")
    return v


def _show(v: Any) -> str:
    """A JSON value for an error message: its type and (short) value."""
    kind = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(v), "null" if v is None else type(v).__name__)
    text = repr(v)
    return f"{kind} {text if len(text) <= 40 else text[:37] + '...'}"


def _bool_field(obj: dict, name: str, param: str | None = None) -> bool | None:
    """An optional JSON boolean (``"false"``, ``"no"``, ``1`` are 400s, as in OpenAI's API)."""
    v = obj.get(name)
    if v is None or isinstance(v, bool):
        return v
    param = param or name
    raise ApiError(400, f"'{param}' must be a JSON boolean (true or false), got {_show(v)}", param=param,
                   code="invalid_type")


def _number_field(body: dict, name: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    """An optional number in ``[lo, hi]`` (``(lo, hi]`` when ``lo_open``); null means the default."""
    v = body.get(name)
    if v is None:
        return None
    rng = f"between {lo:g} and {hi:g} ({'(' if lo_open else '['}{lo:g}, {hi:g}])"
    if not _is_number(v) or not math.isfinite(v):
        raise ApiError(400, f"'{name}' must be a number {rng}, got {_show(v)}", param=name,
                       code="invalid_type")
    if not (lo < v if lo_open else lo <= v) or not v <= hi:
        raise ApiError(400, f"'{name}' must be {rng}, got {v:g}", param=name, code="invalid_value")
    return float(v)


def _token_ids(v: Any, name: str, vocab_size: int) -> list[int]:
    """A list of token ids in ``[0, vocab_size)`` (vLLM: ``_validate_stop_token_ids``)."""
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise ApiError(400, f"'{name}' must be a list of integer token ids, got {_show(v)}", param=name,
                       code="invalid_type")
    bad = [t for t in v if not 0 <= t < vocab_size]
    if bad:
        raise ApiError(400, f"'{name}' contains out-of-vocabulary token ids {bad[:5]}; the vocabulary size is "
                       f"{vocab_size}", param=name, code="invalid_value")
    return list(v)


def _logit_bias(v: Any, vocab_size: int) -> dict[str, float]:
    """``{token id: bias}`` (vLLM: keys ``int()``-convertible, ids in the vocabulary, bias clamped)."""
    if not isinstance(v, dict):
        raise ApiError(400, f"'logit_bias' must be an object of token id -> bias, got {_show(v)}",
                       param="logit_bias", code="invalid_type")
    out: dict[str, float] = {}
    for k, b in v.items():
        try:
            tid = int(k)
        except ValueError:
            raise ApiError(400, f"'logit_bias' key {k!r} is not an integer token id", param="logit_bias",
                           code="invalid_value") from None
        if not 0 <= tid < vocab_size:
            raise ApiError(400, f"'logit_bias' token id {tid} is out of vocabulary (size {vocab_size})",
                           param="logit_bias", code="invalid_value")
        if not _is_number(b) or not math.isfinite(b):
            raise ApiError(400, f"'logit_bias' value of {k!r} must be a number, got {_show(b)}",
                           param="logit_bias", code="invalid_type")
        out[str(tid)] = min(100.0, max(-100.0, float(b)))
    return out


def _check_known(endpoint: Endpoint, body: dict) -> None:
    """Unknown parameters and refused values are 400s naming the parameter (never accepted and ignored)."""
    known = parameters(endpoint)
    for name, value in body.items():
        p = known.get(name)
        if p is None:
            other = "chat" if endpoint == "completions" else "completions"
            hint = (f" (it is a /v1/{'chat/' if other == 'chat' else ''}completions parameter)"
                    if name in parameters(other) else "")
            raise ApiError(400, f"Unrecognized request argument supplied: {name}{hint}", param=name,
                           code="unknown_parameter")
        if p.support == "refused" and not any(_same(value, a) for a in p.allowed):
            raise ApiError(400, f"'{name}' is not supported by Kairos: {p.how}; got {_show(value)}", param=name,
                           code="unsupported_parameter")


def _sampling(body: dict, vocab_size: int) -> SamplingParams:
    """Type/range checks of the sampling parameters (vLLM's ``SamplingParams._verify_args`` rules) and
    the :class:`~kairos.contracts.wire.SamplingParams` that carries them on the bus."""
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
            raise ApiError(400, f"'stop' must be a string or a list of strings, got {_show(stop)}", param="stop",
                           code="invalid_type")
        if any(not x for x in stop):
            raise ApiError(400, "'stop' cannot contain an empty string", param="stop", code="invalid_value")
        stop = stop or None
    stop_ids = body.get("stop_token_ids")
    top_k = _int_field(body, "top_k", None, -1)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError(400, f"'user' must be a string, got {_show(user)}", param="user", code="invalid_type")
    rep = body.get("repetition_penalty")
    if rep is not None and (not _is_number(rep) or not math.isfinite(rep) or rep <= 0):
        raise ApiError(400, f"'repetition_penalty' must be a finite number > 0, got {_show(rep)}",
                       param="repetition_penalty", code="invalid_type" if not _is_number(rep) else "invalid_value")
    return SamplingParams(
        temperature=_number_field(body, "temperature", 0.0, 2.0),
        top_p=_number_field(body, "top_p", 0.0, 1.0, lo_open=True),
        top_k=top_k,
        min_p=_number_field(body, "min_p", 0.0, 1.0),
        seed=_int_field(body, "seed", None, SEED_MIN, SEED_MAX),
        stop=stop,
        stop_token_ids=None if stop_ids is None else _token_ids(stop_ids, "stop_token_ids", vocab_size) or None,
        min_tokens=_int_field(body, "min_tokens", None, 0),
        ignore_eos=_bool_field(body, "ignore_eos"),
        logit_bias=None if body.get("logit_bias") is None else _logit_bias(body["logit_bias"], vocab_size) or None,
        presence_penalty=_number_field(body, "presence_penalty", -2.0, 2.0),
        frequency_penalty=_number_field(body, "frequency_penalty", -2.0, 2.0),
        repetition_penalty=None if rep is None else float(rep),
        include_stop_str_in_output=_bool_field(body, "include_stop_str_in_output"),
        skip_special_tokens=_bool_field(body, "skip_special_tokens"),
    )


def _chat_content(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"messages[{i}].content[{j}]: only text parts are supported",
                               param=f"messages[{i}].content", code="invalid_value")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                   param=f"messages[{i}].content", code="invalid_type")


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` history: ``[{id, type: "function", function: {name, arguments}}]``."""
    param = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise ApiError(400, f"{param} must be a list, got {_show(calls)}", param=param, code="invalid_type")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if (not isinstance(fn, dict) or not isinstance(fn.get("name"), str)
                or not isinstance(fn.get("arguments", ""), str) or c.get("type", "function") != "function"):
            raise ApiError(400, f"{param}[{j}] must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\": "
                           f"string, \"arguments\": string}}}}", param=param, code="invalid_type")
        out.append({"id": str(c.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": fn.get("arguments", "")}})
    return out


def _chat_messages(msgs: Any) -> list[dict[str, Any]]:
    """Validated, normalized chat messages (``role``, ``content`` text, optional ``tool_calls`` /
    ``tool_call_id`` / ``name``), as a chat template takes them."""
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages",
                       code="missing_required_parameter" if msgs is None else "invalid_type")
    norm = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a 'role'", param=f"messages[{i}]",
                           code="invalid_type")
        if m["role"] not in CHAT_ROLES:
            raise ApiError(400, f"messages[{i}].role {m['role']!r} is not one of {', '.join(CHAT_ROLES)}",
                           param=f"messages[{i}].role", code="invalid_value")
        unknown = sorted(set(m) - CHAT_MESSAGE_FIELDS)
        if unknown:
            raise ApiError(400, f"messages[{i}] has unsupported field(s) {', '.join(map(repr, unknown))} (supported: "
                           f"{', '.join(sorted(CHAT_MESSAGE_FIELDS))})", param=f"messages[{i}].{unknown[0]}",
                           code="invalid_value")
        content = m.get("content")
        if content is None:
            if m["role"] != "assistant" or m.get("tool_calls") is None:  # only a tool-calling turn may omit it
                raise ApiError(400, f"messages[{i}].content is required for role {m['role']!r}",
                               param=f"messages[{i}].content", code="missing_required_parameter")
            content = ""
        if m["role"] == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise ApiError(400, f"messages[{i}]: a tool message needs 'tool_call_id' (the id of the call it answers)",
                           param=f"messages[{i}].tool_call_id", code="missing_required_parameter")
        msg: dict[str, Any] = {"role": m["role"], "content": _chat_content(content, i)}
        if m.get("tool_calls") is not None:
            if m["role"] != "assistant":
                raise ApiError(400, f"messages[{i}].tool_calls is only allowed on assistant messages",
                               param=f"messages[{i}].tool_calls", code="invalid_value")
            msg["tool_calls"] = _tool_calls(m["tool_calls"], i)
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise ApiError(400, f"messages[{i}].{key} must be a string", param=f"messages[{i}].{key}",
                                   code="invalid_type")
                msg[key] = m[key]
        norm.append(msg)
    return norm


def _completion_prompt(prompt: Any, vocab_size: int, nested: bool = False) -> tuple[str | None, list[int] | None]:
    """``prompt`` of /v1/completions: (text, None) or (None, token ids)."""
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "'prompt' must not be empty", param="prompt", code="invalid_value")
        return prompt, None
    if prompt is None and not nested:
        raise ApiError(400, "'prompt' is required: a string or a list of token ids", param="prompt",
                       code="missing_required_parameter")
    if not isinstance(prompt, list):
        raise ApiError(400, f"'prompt' must be a non-empty string or a list of token ids, got {_show(prompt)}",
                       param="prompt", code="invalid_type")
    if not prompt:
        raise ApiError(400, "'prompt' must not be empty", param="prompt", code="invalid_value")
    if all(_is_number(t) for t in prompt):
        bad = next((i for i, t in enumerate(prompt) if not isinstance(t, int)), None)
        if bad is not None:
            raise ApiError(400, f"'prompt' token ids must be integers; prompt[{bad}] is {_show(prompt[bad])}",
                           param="prompt", code="invalid_type")
        bad = next((i for i, t in enumerate(prompt) if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"'prompt' token id {prompt[bad]} (prompt[{bad}]) is out of vocabulary: ids must be "
                           f">= 0 and < {vocab_size}", param="prompt", code="invalid_value")
        return None, list(prompt)
    if not nested and (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt)):
        if len(prompt) == 1:
            return _completion_prompt(prompt[0], vocab_size, nested=True)  # a batch of one
        raise ApiError(400, f"batched prompts ({len(prompt)} prompts) are not supported; send one prompt per "
                       "request", param="prompt", code="unsupported_value")
    bad = next(i for i, t in enumerate(prompt) if not _is_number(t))
    raise ApiError(400, f"'prompt' must be a string or a list of integer token ids; prompt[{bad}] is "
                   f"{_show(prompt[bad])}", param="prompt", code="invalid_type")


def parse_request(endpoint: Endpoint, body: Any, served_models: list[str], default_max_tokens: int = 16,
                  vocab_size: int = EMULATED_VOCAB_SIZE, chat_template: ChatTemplate | None = None) -> ParsedRequest:
    """Validate an OpenAI request body (the rules of vLLM 0.32's OpenAI server, plus JSON-boolean
    strictness and the refusals of :data:`PARAMETERS`).

    ``max_tokens`` of the result is None for a chat request without ``max_tokens`` /
    ``max_completion_tokens``: :func:`resolve_max_tokens` sets it to the remaining context once the
    prompt is counted (vLLM's default). Token ids (prompt, ``stop_token_ids``, ``logit_bias`` keys)
    must be in ``[0, vocab_size)``.

    Raises:
        ApiError: 400 for a malformed body, an unknown parameter or a refused value (``param`` names
            it), 404 for an unknown model.
    """
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required", param="model", code="missing_required_parameter")
    if model not in served_models:
        raise ApiError(404, f"The model `{model}` does not exist. Served: {', '.join(served_models)}",
                       type_="not_found_error", param="model", code="model_not_found")
    _check_known(endpoint, body)
    n = _int_field(body, "n", 1, 1)
    if n != 1:
        raise ApiError(400, "only n=1 is supported", param="n", code="unsupported_value")
    stream = _bool_field(body, "stream") or False
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not isinstance(so, dict):
            raise ApiError(400, "'stream_options' must be an object", param="stream_options", code="invalid_type")
        if so and not stream:  # vLLM: CompletionRequest.validate_stream_options
            raise ApiError(400, "Stream options can only be defined when `stream=True`.", param="stream_options",
                           code="invalid_value")
        unknown = set(so) - {"include_usage", "continuous_usage_stats"}
        if unknown:
            raise ApiError(400, f"Unrecognized stream_options field: {sorted(unknown)[0]}", param="stream_options",
                           code="unknown_parameter")
        include_usage = bool(_bool_field(so, "include_usage", "stream_options.include_usage"))
        if _bool_field(so, "continuous_usage_stats", "stream_options.continuous_usage_stats"):
            raise ApiError(400, "'stream_options.continuous_usage_stats' is not supported by Kairos",
                           param="stream_options", code="unsupported_parameter")
    sampling = _sampling(body, vocab_size)

    text: str | None = None
    ids: list[int] | None = None
    if endpoint == "completions":
        explicit = body.get("max_tokens") is not None
        max_tokens = _int_field(body, "max_tokens", default_max_tokens, 1)
        text, ids = _completion_prompt(body.get("prompt"), vocab_size)
    else:
        mct = _int_field(body, "max_completion_tokens", None, 1)
        mt = _int_field(body, "max_tokens", None, 1)
        max_tokens = mct if mct is not None else mt
        explicit = max_tokens is not None
        text = (chat_template or render_chat)(_chat_messages(body.get("messages")))
    if max_tokens is not None and sampling.min_tokens is not None and sampling.min_tokens > max_tokens:
        raise ApiError(400, f"'min_tokens' must be <= max_tokens ({max_tokens}), got {sampling.min_tokens}",
                       param="min_tokens", code="invalid_value")
    return ParsedRequest(endpoint=endpoint, model=model, prompt_text=text, prompt_token_ids=ids,
                         max_tokens=max_tokens, stream=stream, include_usage=include_usage, sampling=sampling,
                         max_tokens_explicit=explicit)


def count_prompt_tokens(req: ParsedRequest, counter: TokenCounter | None) -> tuple[int, bool]:
    """(prompt tokens, exact?) — see the module docstring."""
    if req.prompt_token_ids is not None:
        return len(req.prompt_token_ids), True
    assert req.prompt_text is not None
    if counter is not None:  # vLLM: completions add the special tokens, chat prompts carry them already
        return counter(req.prompt_text, req.endpoint == "completions"), True
    return estimate_tokens(req.prompt_text), False


def resolve_max_tokens(req: ParsedRequest, prompt_tokens: int, max_model_len: int) -> ParsedRequest:
    """``req`` with ``max_tokens`` set (chat default: ``max_model_len − prompt_tokens``, as vLLM's
    ``get_max_tokens``) after :func:`check_context` passed for it.

    Raises:
        ApiError: 400 ``context_length_exceeded`` (see :func:`check_context`), or ``min_tokens`` above
            the defaulted ``max_tokens``.
    """
    prompt_param = "prompt" if req.endpoint == "completions" else "messages"
    if req.max_tokens is None:
        check_context(prompt_tokens, 1, max_model_len, prompt_param)
        req = replace(req, max_tokens=max_model_len - prompt_tokens)
        if req.sampling.min_tokens is not None and req.sampling.min_tokens > req.max_tokens:
            raise ApiError(400, f"'min_tokens' ({req.sampling.min_tokens}) exceeds the remaining context "
                           f"({req.max_tokens} tokens after the {prompt_tokens}-token prompt)", param="min_tokens",
                           code="invalid_value")
    check_context(prompt_tokens, req.max_tokens, max_model_len, prompt_param)
    return req


def prepare_request(endpoint: Endpoint, body: Any, served_models: list[str], counter: TokenCounter | None,
                    max_model_len: int, default_max_tokens: int = 16, vocab_size: int = EMULATED_VOCAB_SIZE,
                    chat_template: ChatTemplate | None = None) -> tuple[ParsedRequest, int, bool]:
    """Everything the ingress does before accepting a request: :func:`parse_request`,
    :func:`count_prompt_tokens`, :func:`resolve_max_tokens`. Returns (request, prompt tokens, exact?).

    Raises:
        ApiError: as those functions.
    """
    parsed = parse_request(endpoint, body, served_models, default_max_tokens, vocab_size, chat_template)
    prompt_tokens, exact = count_prompt_tokens(parsed, counter)
    return resolve_max_tokens(parsed, prompt_tokens, max_model_len), prompt_tokens, exact


def check_context(prompt_tokens: int, max_tokens: int, max_model_len: int, prompt_param: str = "prompt") -> None:
    """Raises ApiError 400 ``context_length_exceeded`` when prompt + output exceed the context.

    ``param`` names what to shorten: ``prompt_param`` (``prompt``, chat: ``messages``) when the prompt
    alone leaves no room for a single output token, else ``max_tokens``.
    """
    if prompt_tokens + max_tokens <= max_model_len:
        return
    if prompt_tokens >= max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, your "
                       f"prompt is {prompt_tokens} tokens, which leaves no room for the completion. Please "
                       f"shorten the prompt.", param=prompt_param, code="context_length_exceeded")
    raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                   f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, "
                   f"{max_tokens} for the completion). Please reduce 'max_tokens' to at most "
                   f"{max_model_len - prompt_tokens}.", param="max_tokens", code="context_length_exceeded")


# --------------------------------------------------------------------------------------------
# responses
# --------------------------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """The ``usage`` object; ``prompt_tokens_details.cached_tokens`` = prompt tokens the engine served
    from its prefix cache (``DoneEvent.cached_tokens``)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def full_response(req: ParsedRequest, rid: str, created: int, text: str, finish_reason: str,
                  prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """Non-streaming response body."""
    if req.endpoint == "completions":
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        obj = "chat.completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def stream_chunk(req: ParsedRequest, rid: str, created: int, text: str | None, finish_reason: str | None,
                 first: bool = False) -> dict[str, Any]:
    """One SSE chunk with a text delta (or only the finish reason)."""
    if req.endpoint == "completions":
        choice: dict[str, Any] = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    else:
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    out: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [choice]}
    if req.include_usage:
        out["usage"] = None
    return out


def usage_chunk(req: ParsedRequest, rid: str, created: int, prompt_tokens: int, completion_tokens: int,
                cached_tokens: int = 0) -> dict:
    """The final ``choices: []`` chunk carrying usage (only with stream_options.include_usage)."""
    obj = "text_completion" if req.endpoint == "completions" else "chat.completion.chunk"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def models_response(models: list[str], max_model_len: int | None = None, created: int | None = None) -> dict[str, Any]:
    """``GET /v1/models`` body (with vLLM's ``max_model_len`` extension when known)."""
    c = int(time.time()) if created is None else created
    extra = {"max_model_len": max_model_len} if max_model_len else {}
    return {"object": "list", "data": [{"id": m, "object": "model", "created": c, "owned_by": "kairos", **extra}
                                       for m in models]}


if __name__ == "__main__":  # regenerate the README table: python -m kairos.services.ingress.openai_api
    print(parameter_table_markdown(), end="")
