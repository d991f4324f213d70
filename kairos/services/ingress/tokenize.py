"""``POST /tokenize``, ``POST /detokenize`` and ``GET /version``, shaped as vLLM 0.32's server has them.

Source: ``vllm/entrypoints/serve/tokenize/{protocol,serving,api_router}.py`` and
``vllm/entrypoints/serve/instrumentator/basic.py`` (``/version``). ``vllm bench serve``
(``vllm/benchmarks/serve.py`` ``_align_prompts_to_server_tokenizer``) calls ``/tokenize`` with
``{"model", "prompt", "add_special_tokens": false}`` and ``/detokenize`` with ``{"model", "tokens"}``
to make its prompts as long as it meant, on the server's tokenizer; without them it warns
``/tokenize unavailable, skipping alignment``.

* ``POST /tokenize`` — ``{"model"?, "prompt", "add_special_tokens": true, "return_token_strs": false}``
  or ``{"model"?, "messages", "add_generation_prompt": true, "continue_final_message": false,
  "add_special_tokens": false, "tools"?, "chat_template_kwargs"?, "return_token_strs": false}``
  → ``{"count", "max_model_len", "tokens", "token_strs"}``. Chat messages are validated and
  rendered as ``POST /v1/chat/completions`` renders them (the model's chat template, else the
  fixed one: kairos/services/ingress/openai_api/prompt.py).
* ``POST /detokenize`` — ``{"model"?, "tokens": [int ≥ 0]}`` → ``{"prompt"}`` (special tokens kept,
  as vLLM's ``tokenizer.decode``); an id outside the vocabulary is a 400 naming ``tokens``.
* ``GET /version`` — ``{"version"}``: the Kairos version (vLLM answers its own).

Which tokenizer: the served model's (``KAIROS_TOKENIZER_PATH``, a ``tokenizer.json``) when the
ingress has one: counts are exact. Without one the ingress counts prompts with the estimate
``ceil(utf-8 bytes / 4)``, and ``/tokenize`` answers with the **estimate tokenizer** that gives
that same count (:class:`EstimateTokenizer`): one token per 4 bytes of UTF-8, its id the bytes
themselves (``EMULATED_VOCAB_SIZE + int.from_bytes(b"\\x01" + piece)``), so ``/detokenize`` returns
the text exactly (a cut multi-byte character is dropped), and ids below ``EMULATED_VOCAB_SIZE``
decode as the emulated model's words (kairos/core/engine_model/text.py). ``add_special_tokens`` does
not change an estimate. Every ``/tokenize`` answer says which it was in the header
:data:`COUNTS_HEADER` (``exact`` / ``estimate``).

Errors are the ingress's OpenAI-shaped bodies: 400 naming the parameter (wrong type, both
``prompt`` and ``messages`` or neither, an unknown field, ``chat_template`` / media fields, which
Kairos does not take), 404 ``model_not_found``. Like every path but ``/health``, ``/metrics`` and
``/version``, these need an API key when keys are configured (vLLM leaves them open; its
benchmark's alignment sends no key and then warns as above).
"""

from __future__ import annotations

import asyncio
from importlib import metadata
from typing import Any

import orjson
from aiohttp import web

from kairos.contracts.errors import ErrorCode
from kairos.core.engine_model.text import EMULATED_VOCAB_SIZE, token_text
from kairos.services.ingress.http import api_error_response
from kairos.services.ingress.openai_api.decode import decode
from kairos.services.ingress.openai_api.models import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from kairos.services.ingress.openai_api.parse import parse_request
from kairos.services.ingress.openai_api.prompt import ChatTemplate, encode_ids
from kairos.services.ingress.openai_api.responses import ApiError

#: the response header of ``/tokenize`` saying whether the tokens are the model's (``exact``) or the estimate's
COUNTS_HEADER = "X-Kairos-Token-Counts"
#: bytes of UTF-8 per estimated token (kairos/services/ingress/openai_api/prompt.py ``estimate_tokens``)
ESTIMATE_BYTES = 4
#: fields of vLLM's ``TokenizeChatRequest`` that Kairos cannot apply: refused when set (the request
#: bodies themselves: kairos/services/ingress/openai_api/models.py)
REFUSED_CHAT_FIELDS = ("chat_template", "media_io_kwargs", "mm_processor_kwargs")


class EstimateTokenizer:
    """The estimate tokenizer (module docstring): ``ceil(bytes / 4)`` tokens that decode back exactly."""

    exact = False
    vocab_size = EMULATED_VOCAB_SIZE  #: ids below it are the emulated model's; above, byte pieces

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The ids of ``text``'s UTF-8 in pieces of :data:`ESTIMATE_BYTES` (``add_special_tokens`` unused)."""
        raw = text.encode("utf-8")
        return [EMULATED_VOCAB_SIZE + int.from_bytes(b"\x01" + raw[i:i + ESTIMATE_BYTES], "big")
                for i in range(0, len(raw), ESTIMATE_BYTES)]

    @staticmethod
    def _piece(token_id: int) -> bytes | None:
        """The bytes of a piece id, None if ``token_id`` is not one."""
        v = token_id - EMULATED_VOCAB_SIZE
        if v < 0x100:
            return None
        b = v.to_bytes((v.bit_length() + 7) // 8, "big")
        return b[1:] if b[0] == 1 and len(b) <= ESTIMATE_BYTES + 1 else None

    def check(self, ids: list[int]) -> int | None:
        """The first id this tokenizer cannot decode, None if all can."""
        return next((t for t in ids if t >= EMULATED_VOCAB_SIZE and self._piece(t) is None), None)

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` (pieces joined and read as UTF-8, a cut character dropped; emulated ids
        as their words, special tokens kept)."""
        out: list[str] = []
        run = bytearray()
        for t in ids:
            piece = self._piece(t) if t >= EMULATED_VOCAB_SIZE else None
            if piece is not None:
                run += piece
                continue
            if run:
                out.append(run.decode("utf-8", errors="ignore"))
                run.clear()
            out.append(token_text(t, skip_special_tokens=False))
        if run:
            out.append(run.decode("utf-8", errors="ignore"))
        return "".join(out)

    def token_strs(self, ids: list[int]) -> list[str]:
        """Each id's own text (a piece that cuts a character shows ``�``)."""
        return [p.decode("utf-8", errors="replace") if (p := self._piece(t)) is not None
                else token_text(t, skip_special_tokens=False) for t in ids]


class ModelTokenizer:
    """The served model's tokenizer (HF ``tokenizers``, a local ``tokenizer.json``).

    Raises:
        ValueError: the file cannot be loaded.
    """

    exact = True

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise ValueError(f"cannot load tokenizer {path!r}: {exc}") from None
        self.vocab_size = self._tok.get_vocab_size(True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The ids of ``text`` (:func:`~.openai_api.prompt.encode_ids`: the GIL released meanwhile)."""
        return encode_ids(self._tok, text, add_special_tokens)

    def check(self, ids: list[int]) -> int | None:
        return next((t for t in ids if t >= self.vocab_size), None)

    def decode(self, ids: list[int]) -> str:
        """As vLLM's ``_detokenize_prompt`` (vllm/renderers/base.py): ``tokenizer.decode(ids)``, special tokens kept."""
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_strs(self, ids: list[int]) -> list[str]:
        """vLLM's ``convert_ids_to_tokens``: each id's vocabulary string."""
        return [self._tok.id_to_token(t) or "" for t in ids]


def _check(body: Any) -> None:
    """A JSON object without the chat fields Kairos cannot apply."""
    if not isinstance(body, dict):
        raise ApiError(ErrorCode.INVALID_JSON, "request body must be a JSON object")
    for name in REFUSED_CHAT_FIELDS:
        if body.get(name) is not None:
            raise ApiError(ErrorCode.UNSUPPORTED_PARAMETER, f"'{name}' is not supported by Kairos' /tokenize",
                           param=name)


class Tokenization:
    """The three endpoints (module docstring).

    Args:
        served_model: the model name requests may give (``model`` may also be left out).
        max_model_len: the served model's context length (``/tokenize``'s ``max_model_len``).
        tokenizer_path: the model's ``tokenizer.json`` (None: the estimate tokenizer).
        chat_template: the model's chat template (None: the fixed one), as chat completions use it.
        body_timeout_s: seconds a client has to send its body (408 ``request_timeout`` after).

    Raises:
        ValueError: the tokenizer cannot be loaded.
    """

    def __init__(self, served_model: str, max_model_len: int, tokenizer_path: str | None,
                 chat_template: ChatTemplate | None, body_timeout_s: float = 30.0) -> None:
        self.served_model, self.max_model_len, self.chat_template = served_model, max_model_len, chat_template
        self.body_timeout_s = body_timeout_s
        self.tok: ModelTokenizer | EstimateTokenizer = (ModelTokenizer(tokenizer_path) if tokenizer_path
                                                        else EstimateTokenizer())

    def _model(self, model: str | None) -> None:
        if model is not None and model != self.served_model:
            raise ApiError(ErrorCode.MODEL_NOT_FOUND, f"The model `{model}` does not exist. "
                                                      f"Served: {self.served_model}", param="model")

    def tokens_of(self, body: Any) -> tuple[list[int], bool]:
        """The token ids of a ``/tokenize`` body and whether ``token_strs`` were asked for.

        Raises:
            ApiError: the body is not valid (module docstring).
        """
        _check(body)
        has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
        if has_prompt == has_messages:
            raise ApiError(ErrorCode.MISSING_REQUIRED_PARAMETER if not has_prompt else ErrorCode.INVALID_VALUE,
                           "give either 'prompt' (a string) or 'messages' (a chat)", param="prompt")
        if has_prompt:
            req = decode(TokenizeCompletionRequest, {k: v for k, v in body.items() if k not in REFUSED_CHAT_FIELDS})
            self._model(req.model)
            special = req.add_special_tokens is not False
            return self.tok.encode(req.prompt, special), bool(req.return_token_strs)
        chat = decode(TokenizeChatRequest, {k: v for k, v in body.items() if k not in REFUSED_CHAT_FIELDS})
        self._model(chat.model)
        if chat.add_generation_prompt is False:
            raise ApiError(ErrorCode.UNSUPPORTED_VALUE, "Kairos renders chats with the generation prompt only "
                                                        "('add_generation_prompt': true)",
                           param="add_generation_prompt")
        if chat.continue_final_message:
            raise ApiError(ErrorCode.UNSUPPORTED_VALUE, "'continue_final_message' is not supported by Kairos",
                           param="continue_final_message")
        parts = {k: body[k] for k in ("messages", "tools", "chat_template_kwargs") if body.get(k)}  # {}: none
        if "tools" in parts:  # rendered into the prompt, nothing generated: no tool call to parse (vLLM's
            parts["tool_choice"] = "none"  # TokenizeChatRequest has tools and no tool_choice)
        parsed = parse_request("chat", {"model": self.served_model, **parts}, [self.served_model],
                               vocab_size=self.tok.vocab_size, chat_template=self.chat_template)
        assert parsed.prompt_text is not None
        return self.tok.encode(parsed.prompt_text, bool(chat.add_special_tokens)), bool(chat.return_token_strs)

    def text_of(self, body: Any) -> str:
        """The text of a ``/detokenize`` body.

        Raises:
            ApiError: the body is not valid, or an id is outside the vocabulary.
        """
        if not isinstance(body, dict):
            raise ApiError(ErrorCode.INVALID_JSON, "request body must be a JSON object")
        req = decode(DetokenizeRequest, body)  # 1.0 is 1 (JSON Schema's integer; vLLM's pydantic reads it so)
        self._model(req.model)
        bad = self.tok.check(req.tokens)
        if bad is not None:
            raise ApiError(ErrorCode.INVALID_VALUE, f"'tokens[{req.tokens.index(bad)}]': token id {bad} is out of "
                                                    "vocabulary", param="tokens")
        return self.tok.decode(req.tokens)

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            # in a worker thread: a long prompt takes seconds to tokenize (completions.py, OFFLOAD_BODY_BYTES)
            ids, strs = await asyncio.to_thread(self.tokens_of, await _body(request, self.body_timeout_s))
        except ApiError as exc:
            return _refused(exc)
        out = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
               "token_strs": self.tok.token_strs(ids) if strs else None}
        return _json(out, {COUNTS_HEADER: "exact" if self.tok.exact else "estimate"})

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            text = self.text_of(await _body(request, self.body_timeout_s))
        except ApiError as exc:
            return _refused(exc)
        return _json({"prompt": text})

    async def version(self, _request: web.Request) -> web.Response:
        return _json({"version": kairos_version()})


def kairos_version() -> str:
    """The installed Kairos version (``unknown`` when run from a tree that is not installed)."""
    try:
        return metadata.version("kairos")
    except metadata.PackageNotFoundError:
        return "unknown"


async def _body(request: web.Request, timeout_s: float) -> Any:
    """The JSON body, read within ``timeout_s``. Raises: ApiError (400 ``invalid_json``, 408
    ``request_timeout``); aiohttp's 413 for a body over the limit (the error middleware answers it)."""
    try:
        async with asyncio.timeout(timeout_s):
            raw = await request.read()
    except TimeoutError:
        raise ApiError(ErrorCode.REQUEST_TIMEOUT, f"the request body was not received within {timeout_s:g} s") from None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(ErrorCode.INVALID_JSON, f"request body is not valid JSON: {exc}") from None


def _refused(exc: ApiError) -> web.Response:
    out = api_error_response(exc)
    if exc.code == ErrorCode.REQUEST_TIMEOUT:
        out.force_close()  # the rest of the body is unread
    return out


def _json(body: dict, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(body), content_type="application/json", headers=headers)

