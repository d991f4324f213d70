"""Prompt token counting and chat templates (no I/O but reading the model's files at start).

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
…}</tool_call>\\n``, after its content, so their arguments are counted. A request's ``tools``
(accepted with ``tool_choice: "none"`` only: Kairos' path does not parse tool calls out of the
output) come first, as ``<|tools|>\\n{JSON list}\\n``; a model's template gets them as ``tools``.

Then the context check: prompt + ``max_tokens`` must fit ``max_model_len`` (:func:`check_context`),
and a chat request without ``max_tokens`` gets the remaining context (:func:`resolve_max_tokens`).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any, Callable

from kairos.contracts.errors import ErrorCode
from kairos.services.ingress.openai_api.params import ParsedRequest
from kairos.services.ingress.openai_api.responses import ApiError

#: ``counter(text, add_special_tokens=False) -> tokens`` (see :func:`load_tokenizer`)
TokenCounter = Callable[..., int]
#: ``template(messages, tools=None, **kwargs) -> prompt text``: renders validated chat messages (dicts
#: with role, content, optional tool_calls…), the request's ``tools`` and template keyword arguments
#: (``reasoning_effort``, ``enable_thinking``) into prompt text.
ChatTemplate = Callable[..., str]


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
    return _Tokenizer(tok), tok.get_vocab_size(True)


class _Tokenizer:
    """A loaded tokenizer as a :data:`TokenCounter` (called: the token count, at least 1) that also
    encodes and decodes."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok

    def __call__(self, text: str, add_special_tokens: bool = False) -> int:
        return max(1, len(self.encode(text, add_special_tokens)))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The token ids of ``text`` (with the post-processor's special tokens when ``add_special_tokens``),
        by :func:`encode_ids` (which lets other threads run meanwhile)."""
        return encode_ids(self._tok, text, add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens kept (as vLLM's ``_detokenize_prompt``,
        vllm/renderers/base.py: ``tokenizer.decode(prompt_token_ids)``, whose default keeps them)."""
        return self._tok.decode(ids, skip_special_tokens=False)


def encode_ids(tok: Any, text: str, add_special_tokens: bool) -> list[int]:
    """The ids of ``text`` by the HF ``tokenizers.Tokenizer`` ``tok``, without holding the GIL while
    the Rust tokenizer works: ``Tokenizer.encode`` holds it for the whole encoding (1.6–3.6 s for a
    3.6 MB prompt on the tiny model's tokenizer, during which no other Python thread runs — not the
    ingress's event loop either, even when called from a worker thread), whereas ``encode_batch_fast``
    / ``encode_batch`` release it (``py.allow_threads`` in the tokenizers bindings; measured: the
    event loop thread kept running with gaps of at most ~30 ms). ``encode_batch_fast`` (tokenizers ≥ 0.20)
    skips the character offsets, which only ids are needed without; the ids are the same."""
    batch = getattr(tok, "encode_batch_fast", None) or tok.encode_batch
    return list(batch([text], add_special_tokens=add_special_tokens)[0].ids)


def decode_prompt(ids: list[int], counter: TokenCounter | None) -> str:
    """The text of a token-id prompt (for ``echo``): decoded by the configured tokenizer, else by the
    emulated vocabulary (kairos/core/engine_model/text.py ``token_text``, special tokens kept)."""
    decode = getattr(counter, "decode", None)
    if decode is not None:
        return decode(ids)
    from kairos.core.engine_model.text import token_text

    return "".join(token_text(t, skip_special_tokens=False) for t in ids)


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
    the request's ``tools`` (None without), its template keyword arguments (``reasoning_effort``,
    ``enable_thinking``) and the special tokens of ``tokenizer_config.json`` (``bos_token``…);
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

    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
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
            return template.render(**{**special, **kwargs, "messages": msgs, "add_generation_prompt": True,
                                      "tools": tools, "documents": None})
        except jinja2.TemplateError as exc:
            raise ApiError(ErrorCode.INVALID_VALUE,
                           f"the model's chat template rejected the messages: {exc}", param="messages") from None
        except Exception as exc:  # a template error on this input (TypeError, KeyError…), not ours
            raise ApiError(ErrorCode.INVALID_VALUE, f"the model's chat template cannot render the messages: {exc!r}",
                           param="messages") from None

    return render


def render_chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
    """The module docstring's fixed chat template (tools and tool calls included)."""
    parts = [f"<|tools|>\n{json.dumps(tools, ensure_ascii=False)}\n"] if tools else []
    for m in messages:
        parts.append(f"<|{m['role']}|>\n{m['content']}\n")
        for c in m.get("tool_calls") or ():
            call = json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                              ensure_ascii=False)
            parts.append(f"<tool_call>{call}</tool_call>\n")
    return "".join(parts) + "<|assistant|>\n"


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
            raise ApiError(ErrorCode.INVALID_VALUE,
                           f"'min_tokens' ({req.sampling.min_tokens}) exceeds the remaining context "
                           f"({req.max_tokens} tokens after the {prompt_tokens}-token prompt)", param="min_tokens")
    check_context(prompt_tokens, req.max_tokens, max_model_len, prompt_param)
    return req


def check_context(prompt_tokens: int, max_tokens: int, max_model_len: int, prompt_param: str = "prompt") -> None:
    """Raises ApiError 400 ``context_length_exceeded`` when prompt + output exceed the context.

    ``param`` names what to shorten: ``prompt_param`` (``prompt``, chat: ``messages``) when the prompt
    alone leaves no room for a single output token, else ``max_tokens``.
    """
    if prompt_tokens + max_tokens <= max_model_len:
        return
    if prompt_tokens >= max_model_len:
        raise ApiError(ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                       f"This model's maximum context length is {max_model_len} tokens. However, your "
                       f"prompt is {prompt_tokens} tokens, which leaves no room for the completion. Please "
                       f"shorten the prompt.", param=prompt_param)
    raise ApiError(ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                   f"This model's maximum context length is {max_model_len} tokens. However, you "
                   f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, "
                   f"{max_tokens} for the completion). Please reduce 'max_tokens' to at most "
                   f"{max_model_len - prompt_tokens}.", param="max_tokens")
