"""OpenAI parameters: each is honoured (validated like vLLM 0.32, carried on the bus) or refused with a
400 naming it; chat prompts count tool calls; chat max_tokens defaults to the remaining context."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from kairos.services.ingress import openai_api as oa
from kairos.contracts.wire import SamplingParams
from tests.unit.openai_cases import BAD

MODELS = ["m"]
BASE = {"completions": {"model": "m", "prompt": "hello"},
        "chat": {"model": "m", "messages": [{"role": "user", "content": "hello"}]}}
SAMPLING_FIELDS = set(SamplingParams.__struct_fields__)


def body_with(endpoint: str, name: str, value) -> dict:
    body = {**BASE[endpoint], name: value}
    if name == "stream_options":
        body["stream"] = True
    return body


def reject(body: dict, endpoint: oa.Endpoint = "completions", vocab_size: int = 32000) -> oa.ApiError:
    with pytest.raises(oa.ApiError) as ei:
        oa.parse_request(endpoint, body, MODELS, vocab_size=vocab_size)
    assert ei.value.status == 400 and ei.value.body()["error"]["param"] == ei.value.param
    return ei.value


def cases(kind: str):
    for p in oa.PARAMETERS:
        for ep in (("completions", "chat") if p.endpoints == "both" else (p.endpoints,)):
            value = p.example if kind == "example" else BAD.get(p.name)
            if value is not None:
                yield pytest.param(ep, p, id=f"{ep}-{p.name}")


@pytest.mark.parametrize("endpoint,p", list(cases("example")))
def test_every_accepted_parameter_is_carried(endpoint, p):
    parsed = oa.parse_request(endpoint, body_with(endpoint, p.name, p.example), MODELS)
    if p.name in SAMPLING_FIELDS:  # honoured sampling parameters travel in SamplingParams
        assert getattr(parsed.sampling, p.name) is not None


@pytest.mark.parametrize("endpoint,p", list(cases("bad")))
def test_every_bad_value_is_a_400_naming_the_parameter(endpoint, p):
    e = reject(body_with(endpoint, p.name, BAD[p.name]), endpoint)
    assert re.split(r"[.\[]", e.param)[0] == p.name, (e.param, e.message)


def test_every_parameter_has_a_refused_value_and_both_endpoints_declare_it_alike():
    assert set(BAD) == {p.name for p in oa.PARAMETERS} - {"model"}  # model: any other is a 404
    chat, comp = oa.parameters("chat"), oa.parameters("completions")
    for name in chat.keys() & comp.keys():
        assert (chat[name].support, chat[name].how) == (comp[name].support, comp[name].how), name


def test_every_sampling_field_is_an_honoured_parameter():
    honoured = {p.name for p in oa.PARAMETERS if p.support == "honoured"}
    assert SAMPLING_FIELDS <= honoured


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_unknown_parameters_are_refused(endpoint):
    e = reject({**BASE[endpoint], "temperatur": 0.5}, endpoint)
    assert (e.param, e.code) == ("temperatur", "unknown_parameter")
    e = reject({**BASE["completions"], "max_completion_tokens": 5})
    assert "chat/completions parameter" in e.message


@pytest.mark.parametrize("name,value", [("temperature", 0.7), ("tools", [{"type": "function", "function": {"name": "f"}}]),
                                        ("response_format", {"type": "structural_tag"})])
def test_issue_examples_are_not_accepted_silently(name, value):
    ep = "chat"
    if name == "temperature":
        assert oa.parse_request(ep, {**BASE[ep], name: value}, MODELS).sampling.temperature == 0.7
    else:
        assert reject({**BASE[ep], name: value}, ep).param == name


def test_stream_options_only_with_stream_true():
    e = reject({**BASE["completions"], "stream_options": {"include_usage": True}})
    assert e.param == "stream_options" and "stream=True" in e.message
    e = reject({**BASE["completions"], "stream": False, "stream_options": {"include_usage": True}})
    assert e.param == "stream_options"
    assert oa.parse_request("completions", {**BASE["completions"], "stream_options": None}, MODELS).stream is False


@pytest.mark.parametrize("value", ["false", "no", 1, 0, "true"])
def test_include_usage_must_be_a_json_boolean(value):
    e = reject({**BASE["completions"], "stream": True, "stream_options": {"include_usage": value}})
    assert e.param == "stream_options.include_usage" and e.code == "invalid_type"


def test_include_usage_booleans():
    for v, want in ((True, True), (False, False)):
        p = oa.parse_request("completions", {**BASE["completions"], "stream": True,
                                             "stream_options": {"include_usage": v}}, MODELS)
        assert p.include_usage is want


@pytest.mark.parametrize("name", ["stream", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "echo"])
@pytest.mark.parametrize("value", ["false", 1])
def test_booleans_must_be_json_booleans(name, value):
    e = reject({**BASE["completions"], name: value})
    assert e.param == name


@pytest.mark.parametrize("prompt", [[2147483653], [9223372036854775807], [5, 32000]])
def test_prompt_token_ids_outside_the_vocabulary(prompt):
    e = reject({"model": "m", "prompt": prompt})
    assert e.param == "prompt" and "out of vocabulary" in e.message


def test_token_ids_checked_against_the_served_vocabulary_size():
    ok = oa.parse_request("completions", {"model": "m", "prompt": [99], "stop_token_ids": [99],
                                          "logit_bias": {"99": 5}}, MODELS, vocab_size=100)
    assert ok.prompt_token_ids == [99] and ok.sampling.stop_token_ids == [99]
    assert reject({"model": "m", "prompt": [100]}, vocab_size=100).param == "prompt"
    assert reject({**BASE["completions"], "stop_token_ids": [100]}, vocab_size=100).param == "stop_token_ids"
    assert reject({**BASE["completions"], "logit_bias": {"100": 1}}, vocab_size=100).param == "logit_bias"


@pytest.mark.parametrize("value", [[1000000000], [-1], [1.5], "7"])
def test_stop_token_ids_out_of_range_or_mistyped(value):
    assert reject({**BASE["completions"], "stop_token_ids": value}).param == "stop_token_ids"


def test_an_integral_stop_token_id_is_that_integer():  # vLLM's pydantic list[int] reads 1.0 as 1 (was refused)
    assert oa.parse_request("completions", {**BASE["completions"], "stop_token_ids": [1.0]}, MODELS
                            ).sampling.stop_token_ids == [1]


@pytest.mark.parametrize("value", [{"1000000000": 1}, {"-3": 1}, {"abc": 1}, {"5": "x"}, [1]])
def test_logit_bias_keys_and_values(value):
    assert reject({**BASE["completions"], "logit_bias": value}).param == "logit_bias"


def test_sampling_values_reach_the_wire_struct():
    p = oa.parse_request("completions", {**BASE["completions"], "stop": "dolor", "seed": -(2**63),
                                         "logit_bias": {"7": 150, "8": -300}, "top_k": -1, "min_tokens": 3,
                                         "max_tokens": 8, "ignore_eos": False}, MODELS)
    assert p.sampling == SamplingParams(stop=["dolor"], seed=-(2**63), logit_bias={"7": 100.0, "8": -100.0}, top_k=-1,
                                        min_tokens=3, ignore_eos=False)
    assert msgspec.json.decode(msgspec.json.encode(p.sampling), type=SamplingParams) == p.sampling


def test_vllm_ranges():
    assert reject({**BASE["completions"], "top_p": 0}).param == "top_p"  # vLLM: (0, 1]
    assert reject({**BASE["completions"], "seed": 2**63}).param == "seed"
    assert reject({**BASE["completions"], "stop": ["a", ""]}).param == "stop"
    e = reject({**BASE["completions"], "min_tokens": 9, "max_tokens": 8})
    assert e.param == "min_tokens"


# -- chat: max_tokens default, tools, tool_calls -------------------------------------------------

def test_chat_max_tokens_defaults_to_the_remaining_context():
    p, n, _ = oa.prepare_request("chat", BASE["chat"], MODELS, None, max_model_len=4096)
    assert p.max_tokens == 4096 - n and not p.max_tokens_explicit
    p, n, _ = oa.prepare_request("chat", {**BASE["chat"], "max_tokens": 7}, MODELS, None, max_model_len=4096)
    assert p.max_tokens == 7 and p.max_tokens_explicit
    p, _, _ = oa.prepare_request("chat", {**BASE["chat"], "max_tokens": 7, "max_completion_tokens": 9}, MODELS, None, 4096)
    assert p.max_tokens == 9
    c, _, _ = oa.prepare_request("completions", BASE["completions"], MODELS, None, 4096)
    assert c.max_tokens == 16 and not c.max_tokens_explicit  # OpenAI/vLLM completions default


def test_chat_default_with_a_full_context_names_messages():
    with pytest.raises(oa.ApiError) as ei:
        oa.prepare_request("chat", {"model": "m", "messages": [{"role": "user", "content": "x" * 400}]}, MODELS,
                           None, max_model_len=100)
    assert ei.value.param == "messages" and ei.value.code == "context_length_exceeded"
    with pytest.raises(oa.ApiError) as ei:
        oa.prepare_request("chat", {**BASE["chat"], "min_tokens": 5000}, MODELS, None, max_model_len=4096)
    assert ei.value.param == "min_tokens"


def test_big_tools_are_refused_not_counted_as_nothing():
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"x": "y" * 2000}}} for i in range(100)]
    e = reject({**BASE["chat"], "tools": tools}, "chat")
    assert e.param == "tools" and e.code == "unsupported_parameter"


def test_assistant_tool_calls_and_tool_results_are_counted():
    args = '{"city": "' + "Paris " * 2000 + '"}'
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    p, n, _ = oa.prepare_request("chat", {"model": "m", "messages": msgs, "max_tokens": 5}, MODELS, None, 100000)
    assert "get_weather" in p.prompt_text and args[:50] in p.prompt_text.replace('\\"', '"')
    without, m, _ = oa.prepare_request("chat", {"model": "m", "messages": [msgs[0], {"role": "assistant", "content": ""},
                                                                           msgs[2]], "max_tokens": 5}, MODELS, None, 100000)
    assert n - m >= len(args) // 4 - 10  # the arguments are in the count (estimate: bytes / 4)
    with pytest.raises(oa.ApiError) as ei:
        oa.prepare_request("chat", {"model": "m", "messages": msgs, "max_tokens": 5}, MODELS, None, 1000)
    assert ei.value.code == "context_length_exceeded"


def test_malformed_tool_calls_are_400s():
    bad = {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}
    assert reject({"model": "m", "messages": [bad]}, "chat").param == "messages[0].tool_calls"
    on_user = {"role": "user", "content": "x", "tool_calls": []}
    assert reject({"model": "m", "messages": [on_user]}, "chat").param == "messages[0].tool_calls"


def test_usage_carries_cached_tokens():
    p = oa.parse_request("completions", BASE["completions"], MODELS)
    body = oa.full_response(p, "cmpl-1", 0, "x", "stop", 10, 2, cached_tokens=8)
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert oa.usage_chunk(p, "cmpl-1", 0, 10, 2, 4)["usage"]["prompt_tokens_details"]["cached_tokens"] == 4


# -- docs/api.md -------------------------------------------------------------------------------------

def test_docs_parameter_table_is_the_code_table():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    m = re.search(r"<!-- openai-params:begin -->\n(.*?)<!-- openai-params:end -->", doc, re.S)
    assert m, "docs/api.md lacks the generated OpenAI parameter table"
    assert m.group(1) == oa.parameter_table_markdown(), "docs/api.md table differs: python -m kairos.services.ingress.openai_api"


def test_vllm_bench_serve_payloads_are_accepted():
    """The bodies `vllm bench serve` sends (vllm/benchmarks/lib/endpoint_request_func.py, 0.32)."""
    comp = {"model": "m", "prompt": "hi", "repetition_penalty": 1.0, "max_tokens": 8, "logprobs": None,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    p = oa.parse_request("completions", comp, MODELS)
    assert p.include_usage and p.sampling.ignore_eos and p.max_tokens == 8
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 8,
            "stream": True, "stream_options": {"include_usage": True}}
    assert oa.parse_request("chat", chat, MODELS).max_tokens == 8
