"""The OpenAI request parameters Kairos knows, what it does with each, and the validated request (no I/O).

:data:`PARAMETERS` lists every parameter of ``POST /v1/completions`` and ``POST /v1/chat/completions``
and whether it is honoured (validated as vLLM 0.32's OpenAI server does, carried on the bus in
:class:`~kairos.contracts.wire.SamplingParams`), accepted (no effect, as in vLLM), ignored (no effect
although OpenAI would act on it; named in the ``X-Kairos-Ignored-Params`` response header) or refused
with a 400 naming it (a value vLLM 0.32 accepts is refused only with the reason in ``how``); any other
parameter is a 400 too (:mod:`.parse`). The README's parameter table is
:func:`parameter_table_markdown` (``python -m kairos.services.ingress.openai_api`` prints it).
:class:`ParsedRequest` is what validation returns and the ingress turns into an
:class:`~kairos.contracts.wire.InferenceRequest`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from kairos.contracts.wire import SamplingParams

Endpoint = Literal["completions", "chat"]


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
    #: parameters accepted and not acted on (support ``ignored``, or ``reasoning_effort`` without the
    #: model's chat template), named to the client in ``X-Kairos-Ignored-Params``
    ignored: tuple[str, ...] = ()
    #: completions ``echo``: the prompt text prepended to the output (token-id prompts: decoded)
    echo_text: str | None = None
    #: completions ``echo`` with ``max_tokens: 0``: the answer is the prompt only (vLLM generates one
    #: token and leaves it out: ``echo_without_generation``, vllm/entrypoints/openai/completion/protocol.py)
    echo_only: bool = False
    #: choices per prompt (``n``); > 1 is fanned out at the ingress (kairos/services/ingress/fanout.py)
    n: int = 1
    #: completions with a batched ``prompt``: the prompts after the first (whose text or ids are
    #: ``prompt_text``/``prompt_token_ids``), each ``(text, None)`` or ``(None, token ids)``
    more_prompts: tuple[tuple[str | None, list[int] | None], ...] = ()

    @property
    def fanout(self) -> int:
        """Sub-requests this request becomes (prompts × ``n``); 1: served as one request."""
        return (1 + len(self.more_prompts)) * self.n


Support = Literal["honoured", "refused", "accepted", "ignored"]


@dataclass(frozen=True)
class Param:
    """One request parameter and what Kairos does with it (the README table is generated from these).

    ``support``: ``honoured`` — validated, carried on the bus (:class:`~kairos.contracts.wire.SamplingParams`
    or :class:`~kairos.contracts.wire.InferenceRequest`) and applied by the engine (vLLM, and the emulated
    engine as ``how`` says); ``refused`` — any value other than ``allowed`` is a 400 naming it;
    ``accepted`` — validated, not used for generation, as in vLLM (metadata); ``ignored`` — validated,
    not acted on although OpenAI's API would act on it: a value other than ``noop`` is named in the
    response header ``X-Kairos-Ignored-Params`` (comma-separated, table order). ``example``: a valid
    non-default value; ``bad``: a value that is refused (both used by the tests that tie this table to
    the code).
    """

    name: str
    endpoints: Literal["both", "completions", "chat"]
    support: Support
    how: str
    example: Any = None
    bad: Any = None
    allowed: tuple = (None,)
    noop: tuple = (None,)


#: Every request parameter Kairos knows. A parameter not listed here is a 400 ``unknown_parameter``.
PARAMETERS: tuple[Param, ...] = (
    Param("model", "both", "honoured", "must be the served model (404 otherwise)", example=None),
    Param("prompt", "completions", "honoured", "a string or token ids (< vocabulary size), or a batch: a list of "
          "strings or of token-id lists, each prompt its own routed request(s) (`choices[i].index` = prompt × n + "
          "j, as vLLM's); prompts × n ≤ 64", example=[1, 2, 3], bad=[[1], [-2]]),
    Param("messages", "chat", "honoured", "text content; roles system/developer/user/assistant/tool, and any other "
          "non-empty role, which is passed to the chat template as vLLM does (its custom roles); assistant "
          "`tool_calls` and tool results are rendered into the prompt and counted",
          example=[{"role": "user", "content": "hi"}], bad=[]),
    Param("max_tokens", "both", "honoured", "output limit (→ `finish_reason: length`); prompt + max_tokens ≤ "
          "max_model_len; ≥ 1, completions with `echo: true` ≥ 0 (as vLLM). Default: 16 (completions), the "
          "remaining context (chat)", example=5, bad=0),
    Param("max_completion_tokens", "chat", "honoured", "as `max_tokens` (takes precedence)", example=5, bad=0),
    Param("stream", "both", "honoured", "SSE chunks; a JSON boolean", example=True, bad="true"),
    Param("stream_options", "both", "honoured", "only with `stream: true`; `include_usage` (JSON boolean) adds the "
          "usage chunk; `continuous_usage_stats: true` is refused", example={"include_usage": True},
          bad={"include_usage": "false"}),
    Param("n", "both", "honoured", "1-64 choices per prompt, each its own routed request (own internal id, own "
          "record; the shared prompt meets the prefix cache), merged into one answer: usage's `prompt_tokens` once "
          "per prompt, `completion_tokens` summed (vLLM's sums); streams interleave the choices' chunks with their "
          "`index`. With a `seed`, choice j samples with seed + j (vLLM's parallel sampling; seed + n − 1 above "
          "2^63 − 1: 400 naming `seed`). `temperature: 0` "
          "with n > 1: 400 (vLLM's greedy rule)", example=2, bad=0),
    Param("temperature", "both", "honoured", "[0, 2]; vLLM samples with it; emulated: 0 makes the output depend "
          "on the prompt only", example=0.5, bad=3),
    Param("top_p", "both", "honoured", "(0, 1]; passed to vLLM (no effect on emulated text)", example=0.9, bad=0),
    Param("top_k", "both", "honoured", "integer ≥ -1 (0 or -1: off); passed to vLLM", example=5, bad=-2),
    Param("min_p", "both", "honoured", "[0, 1]; passed to vLLM", example=0.1, bad=1.5),
    Param("seed", "both", "honoured", "64-bit integer; emulated: the output is a function of (seed, index), "
          "without a seed of the prompt; vLLM-CPU engines (`kairos up --engine vllm`): only with temperature 0, "
          "else 400 (it would kill the engine)", example=42, bad="7"),
    Param("stop", "both", "honoured", "string or list of at most 4 non-empty strings (OpenAI's limit; vLLM's "
          "`VLLM_MAX_STOP_STRINGS`, default 4); text is cut before the match (`finish_reason: stop`, the "
          "choice's `stop_reason`: the string that matched)",
          example=["\n"], bad=["a", "b", "c", "d", "e"]),
    Param("stop_token_ids", "both", "honoured", "token ids < vocabulary size; `finish_reason: stop`, the "
          "choice's `stop_reason`: the id (an integer)",
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
    Param("echo", "completions", "honoured", "JSON boolean; the prompt is prepended to the text (a token-id prompt "
          "decoded by the tokenizer, else by the emulated vocabulary), in the first chunk when streaming; usage "
          "unchanged. With `max_tokens: 0` the text is the prompt alone (vLLM generates one token it does not "
          "show: `completion_tokens` 1, `finish_reason: length`)", example=True, bad="yes"),
    Param("logprobs", "both", "honoured", "completions: integer 0-20 (vLLM's default `max_logprobs`), not with "
          "`echo` (prompt logprobs are not carried); chat: JSON boolean. vLLM engines: passed to the engine that "
          "decodes (on the keep path the decode node emits every token the client gets, the first included), "
          "its per-token logprobs carried back on the token events; the choices' `logprobs` as vLLM's "
          "(completions `{text_offset, token_logprobs, tokens, top_logprobs}`, chat `{content: [{token, logprob, "
          "bytes, top_logprobs}]}`), per chunk when streaming. Emulated engines: 400 (no probabilities)",
          example=None, bad="x"),
    Param("top_logprobs", "chat", "honoured", "integer 0-20, > 0 only with `logprobs: true` (as vLLM); the first "
          "`top_logprobs` of the engine's most likely tokens per token", example=0, bad=21),
    Param("best_of", "completions", "refused", "only 1", example=1, bad=2, allowed=(None, 1)),
    Param("suffix", "completions", "refused", "only null", bad="x"),
    Param("response_format", "both", "honoured", "`text`, `json_object` or `json_schema` (`{name, schema, "
          "strict}`); vLLM engines: passed to the engine that decodes (the keep path's decode node, the deflect "
          "path's node), which constrains its output (vLLM's structured outputs); emulated engines: 400 (the ingress "
          "knows its engine kind; emulated text cannot follow a format). vLLM's `structural_tag`: 400 (not carried)",
          example={"type": "json_object"}, bad={"type": "structural_tag"}),
    Param("tools", "chat", "honoured", "function tools (`{type: function, function: {name, description?, "
          "parameters?}}`) only with `tool_choice: \"none\"`: rendered into the prompt by the chat template and "
          "counted, no tool calls parsed out — what vLLM does with `tool_choice: \"none\"`. Without it vLLM "
          "defaults to `auto`, which needs a tool-call parser Kairos' path does not have: 400", example=[],
          bad=[{"type": "function", "function": {"name": "f"}}]),
    Param("tool_choice", "chat", "refused", "only null or \"none\" (`auto`, `required` and named tools need "
          "tool-call parsing of the output, which Kairos' path does not do)", example="none", bad="auto",
          allowed=(None, "none")),
    Param("parallel_tool_calls", "chat", "accepted", "JSON boolean; no effect, as in vLLM, since no tool calls "
          "are parsed", example=False, bad="no"),
    Param("functions", "chat", "refused", "only null (deprecated tools)", bad=[{"name": "f"}]),
    Param("function_call", "chat", "refused", "only null or \"none\"", bad="auto", allowed=(None, "none")),
    Param("modalities", "chat", "refused", "only [\"text\"]", example=["text"], bad=["audio"],
          allowed=(None, ["text"])),
    Param("audio", "chat", "refused", "only null", bad={"voice": "x"}),
    Param("prediction", "chat", "refused", "only null", bad={"type": "content", "content": "x"}),
    Param("store", "chat", "ignored", "JSON boolean; Kairos stores no completions (vLLM ignores it too): `true` is "
          "named in `X-Kairos-Ignored-Params`", example=True, bad="yes", noop=(None, False)),
    Param("metadata", "chat", "ignored", "object of string values (OpenAI's type), for stored completions: "
          "named in `X-Kairos-Ignored-Params` (vLLM ignores it)", example={"k": "v"}, bad={"k": 1}, noop=(None, {})),
    Param("service_tier", "chat", "refused", "only null, \"auto\" or \"default\"", example="auto", bad="flex",
          allowed=(None, "auto", "default")),
    Param("reasoning_effort", "chat", "honoured", "none/minimal/low/medium/high/xhigh/max (vLLM's values); "
          "passed to the model's chat template as `reasoning_effort` and `enable_thinking` (≠ none), as vLLM "
          "does; with the fixed template (no `--tokenizer`) nothing uses it: named in "
          "`X-Kairos-Ignored-Params`", example="low", bad="extreme"),
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
