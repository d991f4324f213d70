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
    ({"n": 65}, "n", "invalid_value", "'n' must be an integer between 1 and 64, got integer 65"),
    ({"temperature": "hot"}, "temperature", "invalid_type",
     "'temperature' must be a number or null, got string \"hot\""),
    ({"stop": ["a", ""]}, "stop", "invalid_value", "'stop[1]' must not be empty"),
    ({"stop": ["a", 1]}, "stop", "invalid_type", "'stop' must be a list of strings: 'stop[1]' is integer 1"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "invalid_value",
     "'reasoning_effort' must be one of \"high\", \"low\", \"max\", \"medium\", \"minimal\", \"none\", \"xhigh\", "
     "got string \"extreme\""),
])
def test_messages_say_what_msgspec_expected_in_words(body, param, code, words):
    """msgspec's ``Expected `float | null`, got `str```, ``Expected `int` <= 64`` (the range's other end
    from the model), ``Invalid enum value 'extreme'`` (the values from the model) in words."""
    endpoint = "chat" if "reasoning_effort" in body else "completions"
    e = refused(endpoint, {**(CHAT if endpoint == "chat" else {"model": "m", "prompt": "x"}), **body})
    assert (e.param, e.code) == (param, code) and words in e.message, e.message


@pytest.mark.parametrize("body,param,message", [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content",
     "'messages[0].content[0].text' must be a string, got integer 5"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}]},
     "messages[0].tool_calls",
     "'messages[0].tool_calls[0].function.arguments' must be a string, got object {\"a\": 1}"),
    ({"tools": [{"function": {"name": "f"}}, {"function": {"name": "g", "parameters": "x"}}]}, "tools",
     "'tools[1].function.parameters' must be an object or null, got string \"x\""),
    ({"response_format": {"type": 5}}, "response_format", "'response_format.type' must be a string, got integer 5"),
])
def test_a_type_error_in_a_nested_field_names_its_full_path_and_the_value_there(body, param, message):
    """Was: the parameter's type and whole value (``'messages[0].content' must be a string or a list
    of objects, got array [{"type": "text", "text": 5}]``), which does not say what is wrong."""
    e = refused("chat", {**CHAT, **body})
    assert (e.param, e.code, e.message) == (param, "invalid_type", message)


@pytest.mark.parametrize("body,message", [
    ({"logit_bias": {"5": "x"}}, "'logit_bias' values must be numbers, got a string"),
    ({"metadata": {"k": 1}}, "'metadata' values must be strings, got an integer"),
])
def test_a_value_msgspec_does_not_locate_is_said_as_msgspec_got_it(body, message):
    """An object's value is at ``[...]`` in msgspec's path (no key): the message says the JSON type
    msgspec got there (was: the whole object, or ``got null`` where it was looked up)."""
    e = refused("chat", {**CHAT, **body})
    assert (e.param, e.code, e.message) == (next(iter(body)), "invalid_type", message)


def test_integral_numbers_in_integer_fields_and_integer_lists_are_those_integers():
    """JSON Schema's integer (``1.0`` is one, as the document's schemas say) and vLLM's pydantic, which
    reads ``1.0`` as 1 in ``int`` and ``list[int]`` fields; a number field keeps its float."""
    body = {"model": "m", "prompt": "x", "max_tokens": 3.0, "temperature": 1.0, "stop_token_ids": [1.0, 2]}
    fixed = integral_ints(body, CompletionRequest)
    assert fixed["max_tokens"] == 3 and type(fixed["max_tokens"]) is int and type(fixed["temperature"]) is float
    plain = {"model": "m", "prompt": "x", "max_tokens": 3, "stop_token_ids": [1]}
    assert integral_ints(plain, CompletionRequest) is plain  # nothing to change: no copy
    req = decode(CompletionRequest, body)  # list items: only when the body does not convert as it is
    assert req.stop_token_ids == [1, 2] and all(type(t) is int for t in req.stop_token_ids)
    assert oa.parse_request("completions", body, ["m"]).sampling.stop_token_ids == [1, 2]


@pytest.mark.parametrize("name,value", [("priority", 0.0), ("best_of", 1.0)])
def test_an_integral_float_is_the_allowed_integer_of_a_refused_parameter(name, value):
    assert oa.parse_request("completions", {"model": "m", "prompt": "x", name: value}, ["m"])
    with pytest.raises(oa.ApiError):  # a boolean is still no integer
        oa.parse_request("completions", {"model": "m", "prompt": "x", name: value == 1.0}, ["m"])


@pytest.mark.parametrize("key", ["٣", "3.0", "x"])  # an Arabic-Indic 3: Python's int() reads it, the document not
def test_logit_bias_keys_are_what_the_document_says(key):
    with pytest.raises(oa.ApiError) as ei:
        oa.parse_request("completions", {"model": "m", "prompt": "x", "logit_bias": {key: 1}}, ["m"])
    assert ei.value.param == "logit_bias"
    assert oa.parse_request("completions", {"model": "m", "prompt": "x", "logit_bias": {" +3 ": 1}}, ["m"])


def test_continuous_usage_stats_is_an_unsupported_value_naming_it():  # docs/errors.md's example
    body = {"model": "m", "prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}}
    e = refused("completions", body)
    assert (e.code, e.param) == ("unsupported_value", "stream_options.continuous_usage_stats")


def test_a_null_value_is_shown_once():
    msg = {"role": "user", "content": [{"type": "text", "text": None}]}
    e = refused("chat", {"model": "m", "messages": [msg]})
    assert "got null" in e.message and "null null" not in e.message, e.message


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
