"""The OpenAI request parameters Kairos knows, what it does with each, and the validated request (no I/O).

:data:`PARAMETERS` lists every parameter of ``POST /v1/completions`` and ``POST /v1/chat/completions``
as the request models declare it (:mod:`.models`, one annotated field each, :func:`~.models.P`):
honoured (validated as vLLM 0.32's OpenAI server does, carried on the bus in
:class:`~kairos.contracts.wire.SamplingParams`), accepted (no effect, as in vLLM), ignored (no effect
although OpenAI would act on it; named in the ``X-Kairos-Ignored-Params`` response header) or refused
with a 400 naming it (a value vLLM 0.32 accepts is refused only with the reason in ``how``); any other
parameter is a 400 too (:mod:`.parse`). The README's parameter table is
:func:`parameter_table_markdown` (``python -m kairos.services.ingress.openai_api`` prints it).
:class:`ParsedRequest` is what validation returns and the ingress turns into an
:class:`~kairos.contracts.wire.InferenceRequest`.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, replace
from typing import Any, Literal

from msgspec import Meta

from kairos.contracts.wire import SamplingParams
from kairos.services.ingress.openai_api.models import ChatCompletionRequest, CompletionRequest, Level, Support

Endpoint = Literal["completions", "chat"]
#: the request model of each endpoint
MODELS: dict[str, type] = {"completions": CompletionRequest, "chat": ChatCompletionRequest}


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


@dataclass(frozen=True)
class Param:
    """One request parameter as its model declares it (:class:`~.models.Support`): ``endpoints`` is
    ``both``, ``completions`` or ``chat``; ``example`` a valid non-default value (None: none given)."""

    name: str
    endpoints: Literal["both", "completions", "chat"]
    support: Level
    how: str
    example: Any = None
    allowed: tuple = (None,)
    noop: tuple = (None,)


def _declared(endpoint: Endpoint) -> dict[str, Param]:
    """The parameters of ``endpoint``'s model, by name, in declaration order.

    Raises:
        TypeError: a field without its :class:`~.models.Support` (a parameter must say what Kairos does).
    """
    hints = typing.get_type_hints(MODELS[endpoint], include_extras=True)
    out = {}
    for name in MODELS[endpoint].__struct_fields__:
        meta = next((m for m in getattr(hints[name], "__metadata__", ()) if isinstance(m, Meta)
                     and "support" in (m.extra or {})), None)
        if meta is None:
            raise TypeError(f"{MODELS[endpoint].__name__}.{name} is declared without its Support (models.P)")
        s: Support = meta.extra["support"]
        out[name] = Param(name, endpoint, s.level, s.how, meta.examples[0] if meta.examples else None, s.allowed,
                          s.noop)
    return out


_BY_NAME: dict[str, dict[str, Param]] = {ep: _declared(ep) for ep in MODELS}  # type: ignore[arg-type]
#: Every request parameter Kairos knows (both endpoints'), the model and the prompt first. A parameter
#: not listed here is a 400 ``unknown_parameter``.
PARAMETERS: tuple[Param, ...] = tuple(sorted(
    [replace(p, endpoints="both") if p.name in _BY_NAME["chat"] else p
     for p in _BY_NAME["completions"].values()]
    + [p for p in _BY_NAME["chat"].values() if p.name not in _BY_NAME["completions"]],
    key=lambda p: p.name not in ("model", "prompt", "messages")))


def parameters(endpoint: Endpoint) -> dict[str, Param]:
    """The :data:`PARAMETERS` of one endpoint, by name."""
    return _BY_NAME[endpoint]


def parameter_table_markdown() -> str:
    """The README's table of supported OpenAI parameters, generated from :data:`PARAMETERS`."""
    rows = ["| parameter | endpoint | support | what Kairos does |", "|---|---|---|---|"]
    rows += [f"| `{p.name}` | {p.endpoints} | {p.support} | {p.how} |" for p in PARAMETERS]
    return "\n".join(rows) + "\n"
