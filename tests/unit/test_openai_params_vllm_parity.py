"""Issue 20: parameters vLLM 0.32 accepts (tools with tool_choice "none", store, metadata,
reasoning_effort, parallel_tool_calls, custom roles) are honoured or accepted-and-ignored with the
names in ``X-Kairos-Ignored-Params``; ``stop`` takes at most 4 strings; completions ``echo``."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from kairos.contracts.wire import sampling_body
from kairos.core.engine_model.text import token_text
from kairos.services.ingress import openai_api as oa
from kairos.services.ingress.openai_api.parse import engine_refusal

MODELS = ["m"]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
COMP = {"model": "m", "prompt": "hello there"}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def reject(endpoint: oa.Endpoint, body: dict) -> oa.ApiError:
    with pytest.raises(oa.ApiError) as ei:
        oa.parse_request(endpoint, body, MODELS)
    assert ei.value.status == 400
    return ei.value


# -- tools / tool_choice -------------------------------------------------------------------------

def test_tools_with_tool_choice_none_are_rendered_into_the_prompt():
    p = oa.parse_request("chat", {**CHAT, "tools": [TOOL], "tool_choice": "none"}, MODELS)
    assert p.prompt_text.startswith("<|tools|>\n") and "get_weather" in p.prompt_text
    plain = oa.parse_request("chat", CHAT, MODELS)
    assert oa.count_prompt_tokens(p, None)[0] > oa.count_prompt_tokens(plain, None)[0]  # counted
    assert p.ignored == ()


@pytest.mark.parametrize("extra", [{}, {"tool_choice": "auto"}, {"tool_choice": "required"},
                                   {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}])
def test_tools_without_tool_choice_none_are_refused(extra):
    e = reject("chat", {**CHAT, "tools": [TOOL], **extra})
    assert e.param in ("tools", "tool_choice")


@pytest.mark.parametrize("tools", [[{"type": "function"}], [{"type": "x", "function": {"name": "f"}}], "f",
                                   [{"type": "function", "function": {"name": "f", "parameters": "x"}}]])
def test_malformed_tools_name_tools(tools):
    assert reject("chat", {**CHAT, "tools": tools, "tool_choice": "none"}).param == "tools"


def test_the_model_template_gets_tools_and_reasoning_effort(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": (
        "{% if tools %}T:{{ tools | map(attribute='function') | map(attribute='name') | join(',') }};{% endif %}"
        "R:{{ reasoning_effort }}/{{ enable_thinking }};{% for m in messages %}{{ m.content }}{% endfor %}")}))
    tpl = oa.load_chat_template(str(tmp_path))
    p = oa.parse_request("chat", {**CHAT, "tools": [TOOL], "tool_choice": "none", "reasoning_effort": "none"},
                         MODELS, chat_template=tpl)
    assert p.prompt_text == "T:get_weather;R:none/False;hello" and p.ignored == ()
    p = oa.parse_request("chat", {**CHAT, "reasoning_effort": "high"}, MODELS, chat_template=tpl)
    assert p.prompt_text == "R:high/True;hello"


# -- accepted and ignored ------------------------------------------------------------------------

def test_store_metadata_and_reasoning_effort_without_a_template_are_named_as_ignored():
    p = oa.parse_request("chat", {**CHAT, "metadata": {"k": "v"}, "store": True, "reasoning_effort": "low",
                                  "parallel_tool_calls": False}, MODELS)
    assert p.ignored == ("store", "metadata", "reasoning_effort")  # table order; parallel_tool_calls: no effect
    quiet = oa.parse_request("chat", {**CHAT, "store": False, "metadata": {}, "parallel_tool_calls": True}, MODELS)
    assert quiet.ignored == ()


@pytest.mark.parametrize("name,value", [("store", "yes"), ("metadata", ["k"]), ("metadata", {"k": 1}),
                                        ("reasoning_effort", "extreme"), ("parallel_tool_calls", 1)])
def test_ignored_parameters_are_still_validated(name, value):
    assert reject("chat", {**CHAT, name: value}).param == name


def test_every_ignored_table_entry_is_reported():
    for p in oa.PARAMETERS:
        if p.support == "ignored":
            ep = "chat" if p.endpoints == "chat" else "completions"
            base = CHAT if ep == "chat" else COMP
            assert p.name in oa.parse_request(ep, {**base, p.name: p.example}, MODELS).ignored, p.name


# -- stop ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_at_most_four_stop_strings(endpoint):
    base = COMP if endpoint == "completions" else CHAT
    assert oa.parse_request(endpoint, {**base, "stop": list("abcd")}, MODELS).sampling.stop == list("abcd")
    e = reject(endpoint, {**base, "stop": list("abcde")})
    assert e.param == "stop" and e.code == "invalid_value" and "at most 4" in e.message


# -- echo ----------------------------------------------------------------------------------------

def test_echo_prepends_the_prompt():
    p = oa.parse_request("completions", {**COMP, "echo": True, "max_tokens": 3}, MODELS)
    body = oa.full_response(p, "cmpl-1", 0, " a b c", "length", 2, 3)
    assert body["choices"][0]["text"] == "hello there a b c"
    assert body["usage"]["completion_tokens"] == 3  # usage unchanged, as vLLM
    first = oa.stream_chunk(p, "cmpl-1", 0, " a", None, echo=True)
    later = oa.stream_chunk(p, "cmpl-1", 0, " b", None)
    assert (first["choices"][0]["text"], later["choices"][0]["text"]) == ("hello there a", " b")
    plain = oa.parse_request("completions", COMP, MODELS)
    assert oa.full_response(plain, "c", 0, " a", "length", 2, 1)["choices"][0]["text"] == " a"
    assert oa.stream_chunk(plain, "c", 0, " a", None, echo=True)["choices"][0]["text"] == " a"


def test_echo_with_max_tokens_zero_is_the_prompt_alone():
    p = oa.parse_request("completions", {**COMP, "echo": True, "max_tokens": 0}, MODELS)
    assert p.echo_only and p.max_tokens == 1  # vLLM: echo_without_generation samples one token
    assert oa.full_response(p, "c", 0, " x", "length", 2, 1)["choices"][0]["text"] == "hello there"
    assert oa.stream_chunk(p, "c", 0, " x", None, echo=True)["choices"][0]["text"] == "hello there"
    assert reject("completions", {**COMP, "max_tokens": 0}).param == "max_tokens"


def test_echo_of_token_ids_decodes_them(tmp_path):
    ids = [1, 5, 9]
    p, _, _ = oa.prepare_request("completions", {"model": "m", "prompt": ids, "echo": True}, MODELS, None, 4096)
    assert p.echo_text == "".join(token_text(t, skip_special_tokens=False) for t in ids)  # emulated vocabulary
    words = ["<unk>", "<s>", "</s>", "hi", "there"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    counter, vocab = oa.load_tokenizer(str(tmp_path / "tokenizer.json"))
    p, n, exact = oa.prepare_request("completions", {"model": "m", "prompt": [1, 3, 4], "echo": True}, MODELS,
                                     counter, 4096, vocab_size=vocab)
    assert p.echo_text == tok.decode([1, 3, 4], skip_special_tokens=False) and (n, exact) == (3, True)
    assert counter("hi there") == 2 and counter.encode("hi there") == [3, 4]


# -- response_format -----------------------------------------------------------------------------

SCHEMA = {"type": "json_schema", "json_schema": {"name": "yn", "schema": {"type": "string", "enum": ["yes", "no"]}}}


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_response_format_is_carried_to_the_engine_on_vllm_and_refused_on_emulated(endpoint):
    base = COMP if endpoint == "completions" else CHAT
    for rf in ({"type": "json_object"}, SCHEMA):
        p = oa.parse_request(endpoint, {**base, "response_format": rf}, MODELS)
        assert p.sampling.response_format == rf
        assert sampling_body(p.sampling)["response_format"] == rf  # what the vLLM backend merges into its body
        assert engine_refusal(p, "vllm") is None and engine_refusal(p, "vllm-cpu") is None
        e = engine_refusal(p, "emulated")
        assert e is not None and e.param == "response_format" and e.status == 400
    text = oa.parse_request(endpoint, {**base, "response_format": {"type": "text"}}, MODELS)
    assert text.sampling.response_format is None and engine_refusal(text, "emulated") is None


@pytest.mark.parametrize("rf,param", [({"type": "structural_tag"}, "response_format"), ("json", "response_format"),
                                      ({"type": "json_schema"}, "response_format.json_schema"),
                                      ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema"),
                                      ({"type": "json_object", "json_schema": {"name": "x"}}, "response_format.json_schema"),
                                      ({"type": "json_object", "x": 1}, "response_format")])
def test_malformed_response_format(rf, param):
    assert reject("completions", {**COMP, "response_format": rf}).param == param
