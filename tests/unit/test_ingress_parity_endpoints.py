"""``/tokenize``, ``/detokenize``, ``/version`` and error bodies as vLLM 0.32's server has them (issue 20).

Shapes from ``vllm/entrypoints/serve/tokenize/protocol.py`` (``TokenizeResponse``: count,
max_model_len, tokens, token_strs; ``DetokenizeResponse``: prompt), ``.../instrumentator/basic.py``
(``/version``: version) and ``vllm/entrypoints/serve/engine/protocol.py`` (``ErrorResponse``:
``error: {message, type, param, code}``). ``vllm bench serve``'s alignment
(``vllm/benchmarks/serve.py`` ``_align_prompts_to_server_tokenizer``) is replayed against the
estimate tokenizer: the prompt it cuts to ``n`` tokens is one the ingress counts as ``n``.
"""

from __future__ import annotations

import json

import aiohttp
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from kairos.services.ingress.config import IngressConfig
from kairos.services.ingress.openai_api.prompt import estimate_tokens, render_chat
from kairos.services.ingress.service import Ingress
from kairos.services.ingress.tokenize import EMULATED_VOCAB_SIZE, EstimateTokenizer
from tests.unit.test_ingress_relay import MODEL, FakeBus

WORDS = ["<unk>", "<s>", "</s>", "[", "]", "user", "assistant", "hi", "there"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }} {% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture
def model_dir(tmp_path):
    """A word-level tokenizer that adds ``<s>`` as its special token, with a chat template beside it."""
    from tokenizers import processors

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "chat_template": TEMPLATE}))
    return tmp_path


async def serve(**cfg) -> tuple[Ingress, str]:
    ing = Ingress(IngressConfig(port=0, served_model=MODEL, log_level="error", **cfg))
    ing.assemble(FakeBus())
    await ing.serve_http()
    return ing, f"http://127.0.0.1:{ing.port}"


@pytest.fixture
async def client():
    async with aiohttp.ClientSession() as http:
        yield http


async def call(http, url: str, body=None, method: str = "POST", **kw) -> tuple[int, dict, dict]:
    async with http.request(method, url, json=body, **kw) as r:
        return r.status, r.headers.copy(), await r.json()


async def test_version_and_tokenize_round_trip_with_the_estimate_tokenizer(client):
    ing, base = await serve()
    try:
        st, _, out = await call(client, base + "/version", method="GET")
        assert st == 200 and set(out) == {"version"} and isinstance(out["version"], str)
        prompt = "héllo wörld, tokenize me!"
        st, hdr, out = await call(client, base + "/tokenize", {"model": MODEL, "prompt": prompt})
        assert st == 200 and set(out) == {"count", "max_model_len", "tokens", "token_strs"}
        assert out["count"] == len(out["tokens"]) == estimate_tokens(prompt)  # what the ingress counts
        assert out["token_strs"] is None and out["max_model_len"] == ing.max_model_len
        assert hdr["X-Kairos-Token-Counts"] == "estimate"
        st, _, back = await call(client, base + "/detokenize", {"model": MODEL, "tokens": out["tokens"]})
        assert st == 200 and back == {"prompt": prompt}
        # a cut multi-byte character is dropped, not garbled
        st, _, cut = await call(client, base + "/detokenize", {"tokens": out["tokens"][:1]})
        assert cut["prompt"] == "hél"
        st, _, strs = await call(client, base + "/tokenize", {"prompt": "abcdefg", "return_token_strs": True})
        assert strs["token_strs"] == ["abcd", "efg"]
        # the emulated model's own ids decode as its words (the text of its output tokens)
        st, _, words = await call(client, base + "/detokenize", {"tokens": [1, 3, 4]})
        assert words == {"prompt": "<s> lorem ipsum"}
        # chat: rendered as chat completions render it, counted as they count it
        msgs = [{"role": "user", "content": "hi there"}]
        st, _, chat = await call(client, base + "/tokenize", {"model": MODEL, "messages": msgs})
        assert st == 200 and chat["count"] == estimate_tokens(render_chat(msgs))
        # with tools (vLLM's TokenizeChatRequest: tools, no tool_choice): counted as the chat counts them
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
        st, _, with_tools = await call(client, base + "/tokenize", {"messages": msgs, "tools": tools})
        assert st == 200 and with_tools["count"] == estimate_tokens(render_chat(msgs, tools)) > chat["count"]
    finally:
        await ing.close()


async def test_vllm_bench_alignment_cuts_a_prompt_to_what_the_ingress_counts(client):
    """``_align_prompts_to_server_tokenizer``: tokenize without special tokens, detokenize the first
    ``prompt_len`` tokens, send that; the ingress then counts ``prompt_len`` prompt tokens."""
    ing, base = await serve()
    try:
        prompt, prompt_len = "The quick brown fox jumps over the lazy dog. " * 7, 20
        _, _, tok = await call(client, base + "/tokenize", {"model": MODEL, "prompt": prompt,
                                                            "add_special_tokens": False})
        assert tok["count"] > prompt_len
        _, _, cut = await call(client, base + "/detokenize", {"model": MODEL, "tokens": tok["tokens"][:prompt_len]})
        assert estimate_tokens(cut["prompt"]) == prompt_len and prompt.startswith(cut["prompt"])
    finally:
        await ing.close()


async def test_tokenize_with_the_models_tokenizer_is_exact(client, model_dir):
    ing, base = await serve(tokenizer_path=str(model_dir / "tokenizer.json"))
    try:
        st, hdr, out = await call(client, base + "/tokenize", {"prompt": "hi there", "return_token_strs": True})
        assert st == 200 and hdr["X-Kairos-Token-Counts"] == "exact"
        assert out["tokens"] == [1, 7, 8] and out["token_strs"] == ["<s>", "hi", "there"]  # add_special_tokens: true
        _, _, plain = await call(client, base + "/tokenize", {"prompt": "hi there", "add_special_tokens": False})
        assert plain["tokens"] == [7, 8]
        msgs = [{"role": "user", "content": "hi"}]  # the model's template, no special tokens added on top
        _, _, chat = await call(client, base + "/tokenize", {"messages": msgs})
        rendered = "<s>[user] hi [assistant]"  # the template by hand
        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        assert chat["tokens"] == tok.encode(rendered, add_special_tokens=False).ids
        st, _, text = await call(client, base + "/detokenize", {"tokens": [1, 7, 8]})
        assert st == 200 and text["prompt"] == "<s> hi there"
        st, _, err = await call(client, base + "/detokenize", {"tokens": [7, len(WORDS)]})
        assert st == 400 and err["error"]["param"] == "tokens" and str(len(WORDS)) in err["error"]["message"]
    finally:
        await ing.close()


@pytest.mark.parametrize("path,body,status,param,code", [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, 400, "prompt", "invalid_value"),
    ("/tokenize", {"model": MODEL}, 400, "prompt", "missing_required_parameter"),
    ("/tokenize", {"prompt": 5}, 400, "prompt", "invalid_type"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens", "invalid_type"),
    ("/tokenize", {"prompt": "a", "frobnicate": 1}, 400, "frobnicate", "unknown_parameter"),
    ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model", "model_not_found"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "chat_template": "{{x}}"}, 400, "chat_template",
     "unsupported_parameter"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": False}, 400,
     "add_generation_prompt", "unsupported_value"),
    ("/tokenize", {"messages": "hi"}, 400, "messages", None),
    ("/detokenize", {}, 400, "tokens", "missing_required_parameter"),
    ("/detokenize", {"tokens": [1, "2"]}, 400, "tokens", "invalid_type"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", "invalid_value"),
    ("/detokenize", {"tokens": [EMULATED_VOCAB_SIZE + 5]}, 400, "tokens", "invalid_value"),
    ("/detokenize", {"tokens": [1], "model": "other"}, 404, "model", "model_not_found"),
])
async def test_tokenize_errors_are_openai_shaped_and_name_the_parameter(client, path, body, status, param, code):
    ing, base = await serve()
    try:
        st, _, err = await call(client, base + path, body)
        assert st == status, err
        assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}
        assert err["error"]["param"] == param and (code is None or err["error"]["code"] == code), err
    finally:
        await ing.close()


async def test_a_body_that_is_not_json_is_a_400(client):
    ing, base = await serve()
    try:
        async with client.post(base + "/tokenize", data=b"{nope") as r:
            err = await r.json()
            assert r.status == 400 and err["error"]["code"] == "invalid_json"
    finally:
        await ing.close()


async def test_with_api_keys_version_is_open_and_tokenize_needs_the_key(client):
    ing, base = await serve(api_keys=("k1",))
    try:
        assert (await call(client, base + "/version", method="GET"))[0] == 200
        assert (await call(client, base + "/tokenize", {"prompt": "a"}))[0] == 401
        st, _, out = await call(client, base + "/tokenize", {"prompt": "a"}, headers={"Authorization": "Bearer k1"})
        assert st == 200 and out["count"] == 1
    finally:
        await ing.close()


def test_the_estimate_tokenizer_round_trips_any_text_and_counts_as_the_estimate():
    tok = EstimateTokenizer()
    for text in ["", "a", "abcd", "abcde", "日本語のテキスト", "emoji 🎉🎉 mixed ascii", "\x00\x01 nul bytes"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text and len(ids) == (estimate_tokens(text) if text else 0)
        assert all(i >= EMULATED_VOCAB_SIZE for i in ids) and tok.check(ids) is None


async def test_what_the_document_allows_in_tokenize_bodies_is_served(client):
    """An integral number is a token id (``1.0``: JSON Schema's integer, vLLM's pydantic reads it as 1) and
    an empty ``chat_template_kwargs`` changes nothing (both were 400s the document did not declare); a
    non-empty one is refused as on chat completions."""
    ing, base = await serve()
    try:
        st, _, text = await call(client, base + "/detokenize", {"tokens": [1.0, 2]})
        assert st == 200 and text == (await call(client, base + "/detokenize", {"tokens": [1, 2]}))[2]
        msgs = [{"role": "user", "content": "a"}]
        st, _, out = await call(client, base + "/tokenize", {"messages": msgs, "chat_template_kwargs": {}})
        assert st == 200 and out == (await call(client, base + "/tokenize", {"messages": msgs}))[2]
        st, _, err = await call(client, base + "/tokenize", {"messages": msgs, "chat_template_kwargs": {"x": 1}})
        assert (st, err["error"]["param"]) == (400, "chat_template_kwargs")
    finally:
        await ing.close()
