"""logprobs / top_logprobs (issue 20): validation as vLLM 0.32's protocol, the emulated engine's
refusal, vLLM's streamed completion logprobs parsed per token, and the response shapes of
vllm/entrypoints/openai/{completion,chat_completion}/serving.py."""

from __future__ import annotations

import pytest

from kairos.contracts.events import TokenEvent, TokenLogprob
from kairos.contracts.wire import decode, encode
from kairos.engines.vllm.api import decode_body, parse_sse_line
from kairos.contracts.wire import InferenceRequest
from kairos.services.ingress.openai_api.parse import engine_refusal, prepare_request
from kairos.services.ingress.openai_api.responses import ApiError, choice_logprobs, full_response, stream_chunk

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMP = {"model": "m", "prompt": "hi"}


def parse(endpoint, **kw):
    base = COMP if endpoint == "completions" else CHAT
    return prepare_request(endpoint, {**base, **kw}, ["m"], None, 4096)[0]


def refused(endpoint, **kw) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse(endpoint, **kw)
    return e.value


def test_completions_logprobs_validated_as_vllm():
    assert parse("completions").sampling.logprobs is None
    assert parse("completions", logprobs=0).sampling.logprobs == 0
    assert parse("completions", logprobs=20).sampling.logprobs == 20
    for bad in (21, -1, True, "2", 1.5):
        assert refused("completions", logprobs=bad).param == "logprobs"
    assert refused("completions", logprobs=1, echo=True).param == "logprobs"  # prompt logprobs: not carried
    assert refused("completions", top_logprobs=1).param == "top_logprobs"  # a chat parameter


def test_chat_logprobs_validated_as_vllm():
    assert parse("chat").sampling.logprobs is None
    assert parse("chat", logprobs=False).sampling.logprobs is None
    assert parse("chat", logprobs=True).sampling.logprobs == 0
    assert parse("chat", logprobs=True, top_logprobs=5).sampling.logprobs == 5
    assert parse("chat", top_logprobs=0).sampling.logprobs is None
    e = refused("chat", top_logprobs=2)  # vLLM: "when using `top_logprobs`, `logprobs` must be set to true."
    assert e.param == "top_logprobs" and "logprobs" in e.message
    assert refused("chat", logprobs=1).param == "logprobs"
    assert refused("chat", logprobs=True, top_logprobs=21).param == "top_logprobs"


def test_emulated_engines_refuse_logprobs_naming_it():
    for ep, kw in (("completions", {"logprobs": 0}), ("chat", {"logprobs": True, "top_logprobs": 2})):
        p = parse(ep, **kw)
        err = engine_refusal(p, "emulated")
        assert err is not None and err.status == 400 and err.param == "logprobs"
        assert engine_refusal(p, "vllm-cpu") is None
    assert engine_refusal(parse("chat"), "emulated") is None


def test_the_vllm_decode_body_asks_for_logprobs():
    p = parse("completions", logprobs=3)
    req = InferenceRequest(request_id="r", model="m", prompt_tokens=1, max_tokens=2, prompt_text="hi",
                           created_unix_ms=0.0, deadline_unix_ms=1.0, sampling=p.sampling)
    assert decode_body(req, "m")["logprobs"] == 3
    assert "logprobs" not in decode_body(InferenceRequest(request_id="r", model="m", prompt_tokens=1, max_tokens=2,
                                                          prompt_text="hi", created_unix_ms=0.0,
                                                          deadline_unix_ms=1.0), "m")


def test_vllm_stream_logprobs_parsed_per_token_and_carried_on_the_wire():
    line = ('data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":" a b","token_ids":[5,6],'
            '"logprobs":{"text_offset":[0,2],"token_logprobs":[-0.5,-1.25],"tokens":[" a"," b"],'
            '"top_logprobs":[{" a":-0.5,"x":-2.0},{" b":-1.25}]},"finish_reason":null}]}')
    d = parse_sse_line(line)
    assert d.logprobs == [TokenLogprob(" a", -0.5, [(" a", -0.5), ("x", -2.0)]), TokenLogprob(" b", -1.25, [(" b", -1.25)])]
    assert parse_sse_line('data: {"choices":[{"index":0,"text":"a","token_ids":[5]}]}').logprobs is None
    ev = TokenEvent(request_id="r", first_index=0, count=2, text=" a b", node="n", sent_unix_ms=1.0, logprobs=d.logprobs)
    assert decode(encode(ev), TokenEvent).logprobs == d.logprobs


ENTRIES = [TokenLogprob(" a", -0.5, [(" a", -0.5), ("x", -2.0), ("y", -3.0)]), TokenLogprob("é", -1.0, [("é", -1.0)])]


def test_completion_logprobs_shape():
    p = parse("completions", logprobs=2)
    assert choice_logprobs(p, ENTRIES) == {"text_offset": [0, 2], "token_logprobs": [-0.5, -1.0], "tokens": [" a", "é"],
                                           "top_logprobs": [{" a": -0.5, "x": -2.0, "y": -3.0}, {"é": -1.0}]}
    assert choice_logprobs(p, ENTRIES[1:], text_offset=7)["text_offset"] == [7]  # a stream's later chunk
    body = full_response(p, "cmpl-1", 0, " aé", "length", 1, 2, logprobs=ENTRIES)
    assert body["choices"][0]["logprobs"]["tokens"] == [" a", "é"]
    assert full_response(parse("completions"), "cmpl-1", 0, "x", "length", 1, 1)["choices"][0]["logprobs"] is None


def test_chat_logprobs_shape_takes_top_logprobs_entries():
    p = parse("chat", logprobs=True, top_logprobs=2)
    lp = choice_logprobs(p, ENTRIES)
    assert lp == {"content": [
        {"token": " a", "logprob": -0.5, "bytes": [32, 97], "top_logprobs": [
            {"token": " a", "logprob": -0.5, "bytes": [32, 97]}, {"token": "x", "logprob": -2.0, "bytes": [120]}]},
        {"token": "é", "logprob": -1.0, "bytes": [195, 169], "top_logprobs": [
            {"token": "é", "logprob": -1.0, "bytes": [195, 169]}]}]}
    assert [c["top_logprobs"] for c in choice_logprobs(parse("chat", logprobs=True), ENTRIES)["content"]] == [[], []]
    chunk = stream_chunk(p, "chatcmpl-1", 0, " a", None, logprobs=choice_logprobs(p, ENTRIES[:1]))
    assert len(chunk["choices"][0]["logprobs"]["content"]) == 1
    assert full_response(p, "c", 0, " aé", "stop", 1, 2, logprobs=ENTRIES)["choices"][0]["logprobs"] == lp
