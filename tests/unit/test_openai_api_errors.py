"""OpenAI request validation: every rejection is a 400 that names the parameter and the problem."""

from __future__ import annotations

import pytest

from kairos.services.ingress import openai_api as oa

MODELS = ["m"]


def reject(body: dict, endpoint: oa.Endpoint = "completions") -> oa.ApiError:
    with pytest.raises(oa.ApiError) as ei:
        oa.parse_request(endpoint, {"model": "m", **body}, MODELS)
    assert ei.value.status == 400 and ei.value.body()["error"]["message"]
    return ei.value


def accept(body: dict, endpoint: oa.Endpoint = "completions") -> oa.ParsedRequest:
    return oa.parse_request(endpoint, {"model": "m", **body}, MODELS)


@pytest.mark.parametrize("prompt,where", [([1.5, 2], "prompt[0]"), ([[3, 1.5]], "prompt[0][1]"), ([2.0, 2.5], "prompt[1]")])
def test_fractional_token_ids_say_token_ids_must_be_integers_and_where(prompt, where):
    e = reject({"prompt": prompt})
    assert e.param == "prompt" and e.code == "invalid_type" and "token ids must be integers" in e.message
    assert f"{where} is number" in e.message, e.message


def test_integral_float_token_ids_are_those_integers():  # as int fields (fields.int_field), vLLM's lax pydantic
    assert accept({"prompt": [1, 2.0, 3e0]}).prompt_token_ids == [1, 2, 3]
    assert accept({"prompt": [[1.0], [2]]}).prompt_token_ids == [1]


def test_an_empty_prompt_of_a_batch_is_named():
    e = reject({"prompt": ["a", ""]})
    assert e.param == "prompt" and "'prompt[1]' must not be empty" in e.message


def test_an_out_of_range_integer_is_shown_as_sent():
    e = reject({"prompt": "x", "seed": 2**63})
    assert e.param == "seed" and f"{2**63} is above the maximum {2**63 - 1}" in e.message
    assert f"{-(2**63) - 1} is below the minimum" in reject({"prompt": "x", "seed": -(2**63) - 1}).message


def test_batched_prompts_are_accepted_as_a_batch():  # issue 20: fanned out at the ingress (fanout.py)
    for prompt in (["a", "b"], [[1], [2]]):
        p = oa.parse_request("completions", {"model": "m", "prompt": prompt}, MODELS)
        assert len(p.more_prompts) == 1 and p.fanout == 2


def test_mixed_prompt_list_names_the_bad_element():
    e = reject({"prompt": [1, "a"]})
    assert e.code == "invalid_type" and "prompt[1]" in e.message


def test_prompt_forms_still_accepted():
    assert accept({"prompt": "x"}).prompt_text == "x"
    assert accept({"prompt": [1, 2]}).prompt_token_ids == [1, 2]
    assert accept({"prompt": [[3]]}).prompt_token_ids == [3]
    assert accept({"prompt": ["y"]}).prompt_text == "y"


@pytest.mark.parametrize("value", [1e26, 10 ** 30, 2 ** 31])
def test_huge_max_tokens_is_out_of_range(value):
    e = reject({"prompt": "x", "max_tokens": value})
    assert e.param == "max_tokens" and e.code == "invalid_value" and "out of range" in e.message


def test_fractional_max_tokens_must_be_an_integer():
    e = reject({"prompt": "x", "max_tokens": 2.5})
    assert e.code == "invalid_type" and "must be an integer" in e.message


@pytest.mark.parametrize("field,value,code", [
    ("temperature", "hot", "invalid_type"), ("temperature", 2.5, "invalid_value"), ("temperature", True, "invalid_type"),
    ("top_p", -0.1, "invalid_value"), ("top_p", [1], "invalid_type"),
    ("presence_penalty", 3, "invalid_value"), ("frequency_penalty", "x", "invalid_type"),
    ("stop", 5, "invalid_type"), ("stop", ["a", 1], "invalid_type"), ("seed", "7", "invalid_type"),
    ("user", 1, "invalid_type"), ("n", 65, "invalid_value"),
])
def test_sampling_options_are_type_and_range_checked(field, value, code):
    e = reject({"prompt": "x", field: value})
    assert e.param == field and e.code == code, (e.param, e.code, e.message)
    assert field in e.message


def test_well_typed_sampling_options_are_accepted():
    accept({"prompt": "x", "temperature": 0, "top_p": 0.9, "presence_penalty": -1.5, "frequency_penalty": 0.5,
            "stop": ["\n", "END"], "seed": 42, "user": "u", "n": 1})
    accept({"prompt": "x", "stop": "\n", "temperature": None})


def test_custom_chat_roles_go_to_the_template_and_an_empty_role_is_rejected():
    """vLLM 0.32 accepts any role (CustomChatCompletionMessageParam) and hands it to the template."""
    p = oa.parse_request("chat", {"model": "m", "messages": [{"role": "user", "content": "a"},
                                                             {"role": "wizard", "content": "b"}]}, ["m"])
    assert "<|wizard|>\nb\n" in p.prompt_text
    e = reject({"messages": [{"role": "user", "content": "a"}, {"role": "", "content": "b"}]}, "chat")
    assert e.param == "messages[1].role" and e.code == "invalid_value"


def test_known_chat_roles_are_accepted():
    msgs = [{"role": r, "content": "x", **({"tool_call_id": "c1"} if r == "tool" else {})} for r in oa.CHAT_ROLES]
    msgs.insert(2, {"role": "assistant", "content": None,  # a tool-calling assistant turn
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]})
    assert "<|developer|>" in accept({"messages": msgs}, "chat").prompt_text


@pytest.mark.parametrize("msg,param,code", [
    ({"role": "user"}, "messages[0].content", "missing_required_parameter"),  # was 200 with 83 tokens
    ({"role": "assistant", "content": None}, "messages[0].content", "missing_required_parameter"),
    ({"role": "user", "content": "hi", "foo": 1}, "messages[0].foo", "invalid_value"),  # was silently ignored
    ({"role": "tool", "content": "42"}, "messages[0].tool_call_id", "missing_required_parameter"),
])
def test_chat_messages_like_openai_refuses_them(msg, param, code):
    with pytest.raises(oa.ApiError) as ei:
        accept({"messages": [msg]}, "chat")
    assert ei.value.status == 400 and ei.value.param == param and ei.value.code == code


def test_context_length_names_the_prompt_when_the_prompt_alone_is_too_long():
    with pytest.raises(oa.ApiError) as ei:
        oa.check_context(5000, 16, 4096)
    assert ei.value.param == "prompt" and ei.value.code == "context_length_exceeded" and "5000" in ei.value.message
    with pytest.raises(oa.ApiError) as ei:
        oa.check_context(5000, 16, 4096, prompt_param="messages")
    assert ei.value.param == "messages"


def test_context_length_names_max_tokens_when_the_prompt_fits():
    with pytest.raises(oa.ApiError) as ei:
        oa.check_context(4000, 200, 4096)
    assert ei.value.param == "max_tokens" and "at most 96" in ei.value.message
    oa.check_context(4000, 96, 4096)  # fits exactly


@pytest.mark.parametrize("model,code", [(5, "invalid_type"), (["m"], "invalid_type"), (None, "missing_required_parameter"),
                                        ("", "missing_required_parameter")])
def test_a_model_that_is_not_a_string_is_a_type_error(model, code):
    with pytest.raises(oa.ApiError) as ei:
        oa.parse_request("completions", {"model": model, "prompt": "x"}, ["m"])
    assert (ei.value.param, ei.value.code) == ("model", code), ei.value.message
