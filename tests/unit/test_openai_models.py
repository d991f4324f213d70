"""Validation through the request models (issue 36): what changed where the models decide, and how
msgspec's errors become OpenAI errors naming the parameter (kairos/services/ingress/openai_api/decode.py).

Each changed case says which way vLLM 0.32 goes (its ``ChatCompletionRequest`` / ``CompletionRequest``
pydantic models, vllm/entrypoints/openai/*/protocol.py, the message types from the ``openai`` package).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kairos.services.ingress import openai_api as oa
from kairos.services.ingress.openai_api.decode import decode, integral_ints
from kairos.services.ingress.openai_api.models import ChatCompletionRequest, CompletionRequest, DetokenizeRequest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def refused(endpoint: oa.Endpoint, body: dict) -> oa.ApiError:
    with pytest.raises(oa.ApiError) as ei:
        oa.parse_request(endpoint, body, ["m"])
    assert ei.value.status == 400
    return ei.value


def test_a_tool_call_id_must_be_a_string():  # vLLM: ChatCompletionMessageToolCallParam id: Required[str]
    call = {"id": 5, "type": "function", "function": {"name": "f", "arguments": "{}"}}
    e = refused("chat", {"model": "m", "messages": [{"role": "assistant", "content": None, "tool_calls": [call]}]})
    assert (e.param, e.code) == ("messages[0].tool_calls", "invalid_type")


def test_a_missing_field_of_a_nested_object_is_missing_required_parameter():
    e = refused("completions", {"model": "m", "prompt": "x", "response_format": {"type": "json_schema",
                                                                                 "json_schema": {"schema": {}}}})
    assert (e.param, e.code) == ("response_format.json_schema", "missing_required_parameter")
    assert "'response_format.json_schema.name' is required" in e.message


def test_an_unknown_field_of_stream_options_is_refused_naming_it():
    """vLLM's ``StreamOptions`` (an ``OpenAIBaseModel``) would drop it with a warning in its log;
    Kairos refuses it, as every parameter it would not act on (was: ``unknown_parameter`` naming
    ``stream_options``; now as an unknown field of a message: ``invalid_value`` naming the field)."""
    e = refused("completions", {"model": "m", "prompt": "x", "stream": True, "stream_options": {"foo": 1}})
    assert (e.param, e.code) == ("stream_options.foo", "invalid_value")


@pytest.mark.parametrize("body,param,code,words", [
    ({"n": 65}, "n", "invalid_value", "an integer between 1 and 64, got integer 65"),
    ({"stop": ["a", ""]}, "stop", "invalid_value", "'stop[1]' must not be empty"),
    ({"logit_bias": {"5": "x"}}, "logit_bias", "invalid_type", "an object of number values"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "invalid_value", 'one of "high", "low"'),
])
def test_messages_describe_the_field_from_its_model(body, param, code, words):
    endpoint = "chat" if "reasoning_effort" in body else "completions"
    e = refused(endpoint, {**(CHAT if endpoint == "chat" else {"model": "m", "prompt": "x"}), **body})
    assert (e.param, e.code) == (param, code) and words in e.message, e.message


def test_integral_numbers_only_in_top_level_integer_fields():
    body = {"model": "m", "prompt": "x", "max_tokens": 3.0, "temperature": 1.0, "stop_token_ids": [1.0]}
    fixed = integral_ints(body, CompletionRequest)
    assert fixed["max_tokens"] == 3 and type(fixed["max_tokens"]) is int
    assert type(fixed["temperature"]) is float and fixed["stop_token_ids"] == [1.0]  # as the 27857c5 readers
    plain = {"model": "m", "prompt": "x", "max_tokens": 3}
    assert integral_ints(plain, CompletionRequest) is plain  # nothing to change: no copy


def test_an_unknown_top_level_field_is_unknown_parameter():  # the /tokenize and /detokenize bodies
    with pytest.raises(oa.ApiError) as ei:
        decode(DetokenizeRequest, {"tokens": [1], "frobnicate": True})
    assert (ei.value.param, ei.value.code) == ("frobnicate", "unknown_parameter")
    assert decode(ChatCompletionRequest, CHAT).messages[0].content == "hi"


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False,
                                                                                        allow_infinity=False)
                     | st.text(max_size=5), lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=8)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["completions", "chat"]), st.data())
def test_any_json_body_is_answered_with_a_request_or_an_api_error(endpoint, data):
    """Every parameter of the endpoint set to any JSON value (some to a well-typed one): validation
    returns a request or raises :class:`ApiError`, never anything else (a 500 at the ingress)."""
    names = sorted(oa.parameters(endpoint))
    body = {"model": "m", **({"prompt": "x"} if endpoint == "completions" else {"messages": CHAT["messages"]})}
    for name in data.draw(st.lists(st.sampled_from(names), max_size=6, unique=True)):
        body[name] = data.draw(_JSON)
    try:
        oa.parse_request(endpoint, body, ["m"])
    except oa.ApiError as exc:
        assert exc.status in (400, 404) and exc.message
