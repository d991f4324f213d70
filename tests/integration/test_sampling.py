"""Sampling parameters through the real stack (ingress → NATS → dispatcher → emulated agents): seed,
stop, stop_token_ids, natural ending / ignore_eos, finish_reason and usage; and the 400s of the issue.

The truth for a stop rule is the same request served by the stack *without* the stop condition:
the stopped response must be exactly its prefix, cut where vLLM's rules say.
"""

from __future__ import annotations

import json

import pytest

from kairos.core.engine_model.text import NATURAL_LENGTH_MAX, NATURAL_LENGTH_MIN, emulated_completion
from kairos.contracts.wire import SamplingParams
from tests.integration.conftest import post_openai, stack

pytestmark = pytest.mark.integration

MODEL = "kairos-emulated"


async def post(st, body: dict, chat: bool = False):
    """(status, the JSON body or the stream's chunks)."""
    status, _, out = await post_openai(st, body, chat, MODEL)
    return status, out



@pytest.mark.parametrize("policy", ["pd", "sl:100000"])  # keep path, deflect path
async def test_seed_and_stop_string(nats_url, policy):
    async with stack(nats_url, policy=policy) as st:
        status, free = await post(st, {"prompt": "alpha beta", "max_tokens": 30, "seed": 11})
        assert status == 200, free
        text = free["choices"][0]["text"]
        assert free["choices"][0]["finish_reason"] == "length" and free["usage"]["completion_tokens"] == 30
        # same seed, another prompt: same text (a function of the seed)
        status, again = await post(st, {"prompt": "gamma", "max_tokens": 30, "seed": 11})
        assert again["choices"][0]["text"] == text
        status, other = await post(st, {"prompt": "alpha beta", "max_tokens": 30, "seed": 12})
        assert other["choices"][0]["text"] != text

        words = text.split()
        stop = words[6]
        cut = text.find(stop)
        expect_tokens = len(text[:cut + len(stop)].split())  # the token that completes the match
        status, body = await post(st, {"prompt": "gamma", "max_tokens": 30, "seed": 11, "stop": stop})
        assert status == 200, body
        ch = body["choices"][0]
        assert (ch["text"], ch["finish_reason"]) == (text[:cut], "stop")
        assert body["usage"]["completion_tokens"] == expect_tokens
        # streaming + include_stop_str_in_output: the chunks add up to the text through the stop string
        status, chunks = await post(st, {"prompt": "gamma", "max_tokens": 30, "seed": 11, "stop": [stop],
                                         "include_stop_str_in_output": True, "stream": True,
                                         "stream_options": {"include_usage": True}})
        assert status == 200, chunks
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text[:cut + len(stop)]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
        usage = chunks[-1]["usage"]
        assert usage["completion_tokens"] == expect_tokens and usage["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_stop_token_ids_and_min_tokens(nats_url):
    async with stack(nats_url, policy="pd") as st:
        ids = [emulated_completion(SamplingParams(seed=5), 40, None, None).token_id(i) for i in range(40)]
        target = ids[9]
        first = ids.index(target)
        status, free = await post(st, {"prompt": [1, 2, 3], "max_tokens": 40, "seed": 5})
        status, body = await post(st, {"prompt": [1, 2, 3], "max_tokens": 40, "seed": 5, "stop_token_ids": [target]})
        assert status == 200, body
        assert body["choices"][0]["finish_reason"] == "stop"
        assert body["usage"]["completion_tokens"] == first + 1
        words = free["choices"][0]["text"].split()
        assert body["choices"][0]["text"] == "".join(" " + w for w in words[:first])  # stop token's text left out
        # min_tokens beyond the stop id: the id cannot end it before (vLLM masks it)
        status, body = await post(st, {"prompt": [1, 2, 3], "max_tokens": 40, "seed": 5, "stop_token_ids": [target],
                                       "min_tokens": first + 5})
        want = emulated_completion(SamplingParams(seed=5, stop_token_ids=[target], min_tokens=first + 5), 40, None, None)
        assert want.n_tokens > first + 5
        assert (body["usage"]["completion_tokens"], body["choices"][0]["finish_reason"]) == (want.n_tokens,
                                                                                           want.finish_reason)


async def test_chat_without_max_tokens_ends_naturally_or_fills_the_context(nats_url):
    async with stack(nats_url, policy="pd") as st:
        status, body = await post(st, {"messages": [{"role": "user", "content": "tell me"}], "seed": 3}, chat=True)
        assert status == 200, body
        assert body["choices"][0]["finish_reason"] == "stop"
        assert NATURAL_LENGTH_MIN <= body["usage"]["completion_tokens"] <= NATURAL_LENGTH_MAX
        # ignore_eos: generate up to the remaining context (max_model_len − prompt), as vLLM does
        max_len = st.ingress.max_model_len
        status, body = await post(st, {"messages": [{"role": "user", "content": "x" * (4 * (max_len - 40))}],
                                       "ignore_eos": True}, chat=True)
        assert status == 200, body
        u = body["usage"]
        assert body["choices"][0]["finish_reason"] == "length"
        assert u["prompt_tokens"] + u["completion_tokens"] == max_len and u["completion_tokens"] < 60


@pytest.mark.parametrize("body,chat,param", [
    ({"prompt": "x", "stream": False, "stream_options": {"include_usage": True}}, False, "stream_options"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": "false"}}, False, "stream_options.include_usage"),
    ({"prompt": [2147483653]}, False, "prompt"),
    ({"prompt": [9223372036854775807]}, False, "prompt"),
    ({"prompt": "x", "stop_token_ids": [1000000000]}, False, "stop_token_ids"),
    ({"prompt": "x", "logit_bias": {"1000000000": 5}}, False, "logit_bias"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
     True, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}, True,
     "response_format"),
    ({"prompt": "x", "n": 65}, False, "n"),
    ({"prompt": "x", "n": 2, "temperature": 0}, False, "n"),
])
async def test_refusals_name_the_parameter(nats_url, body, chat, param):
    async with stack(nats_url, prefill=1, decode=1, dispatchers=1, policy="pd") as st:
        status, out = await post(st, body, chat)
        assert status == 400, out
        assert out["error"]["param"] == param and out["error"]["type"] == "invalid_request_error"


async def test_ingress_with_a_model_tokenizer_and_chat_template(nats_url, tmp_path):
    """An ingress given the served model's tokenizer.json counts chat prompts through the model's chat
    template with that tokenizer and bounds token ids by its vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from kairos.services.ingress.config import IngressConfig
    from kairos.services.ingress.service import Ingress
    from tests.integration.conftest import wait_until

    words = ["<unk>", "<s>", "</s>", "[", "]", "user", "assistant", "hi", "there"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }} "
                                             "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"}))
    async with stack(nats_url, prefill=1, decode=1, dispatchers=1, policy="pd") as st:
        ing = Ingress(IngressConfig(nats_url=nats_url, port=0, replica_id="ingress-tok",
                                    tokenizer_path=str(tmp_path / "tokenizer.json")))
        await ing.start()
        try:
            await wait_until(lambda: ing.view and len(ing.view.nodes) == 2, 10, "the second ingress's view")
            base = f"http://127.0.0.1:{ing.port}"
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 3}
            async with st.http.post(base + "/v1/chat/completions", json=body) as r:
                out = await r.json()
                assert r.status == 200, out
            # the template rendered by hand, counted by the model's tokenizer
            assert out["usage"]["prompt_tokens"] == len(tok.encode("<s>[user] hi there [assistant]",
                                                                   add_special_tokens=False).ids)
            assert out["usage"]["prompt_tokens"] != len(tok.encode("<|user|>\nhi there\n<|assistant|>\n",
                                                                   add_special_tokens=False).ids)
            async with st.http.post(base + "/v1/completions", json={"model": MODEL, "prompt": [8, 9]}) as r:
                err = await r.json()
                assert r.status == 400 and err["error"]["param"] == "prompt" and "< 9" in err["error"]["message"]
        finally:
            await ing.close()


@pytest.mark.parametrize("policy", ["pd", "sl:100000"])  # keep path, deflect path
async def test_vllm_cpu_engines_get_no_seeded_sampled_request_on_any_route(nats_url, policy):
    """Issue 16 §5: a seed with temperature > 0 kills a vLLM-CPU engine at a partial-prefill step,
    which a deflected prefill always has and a keep-path prefill has when its prompt outgrows a
    step; the agent refused only deflected ones, after routing. An ingress of vLLM-CPU engines
    refuses it on every route with a 400 naming ``seed`` before anything is published; greedy
    seeded requests are served. (Emulated nodes behind it: what matters is that nothing reaches them.)"""
    import nats as nats_client

    from kairos.contracts import subjects as S

    nc = await nats_client.connect(nats_url)
    published: list[bytes] = []

    async def on_request(msg) -> None:
        if S.PING_HEADER not in (msg.headers or {}):  # /health's pings go there too
            published.append(msg.data)
    sub = await nc.subscribe(S.ROUTE_SUBJECT, cb=on_request)
    try:
        async with stack(nats_url, policy=policy, ingress_overrides={"engine_kind": "vllm-cpu"}) as st:
            for sampling in ({"seed": 42}, {"seed": 42, "temperature": 0.7}):
                for chat in (False, True):
                    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "alpha beta"}
                    status, out = await post(st, {**body, "max_tokens": 4, **sampling}, chat=chat)
                    assert status == 400 and out["error"]["param"] == "seed", out
                    assert "temperature" in out["error"]["message"], out
            await nc.flush()
            assert published == []  # refused before the request stream
            status, out = await post(st, {"prompt": "alpha beta", "max_tokens": 4, "seed": 42, "temperature": 0})
            assert status == 200 and out["usage"]["completion_tokens"] == 4, out
            await nc.flush()
            assert len(published) == 1
    finally:
        await sub.unsubscribe()
        await nc.close()


async def test_other_engines_serve_seeded_sampled_requests(nats_url):
    async with stack(nats_url, policy="pd", ingress_overrides={"engine_kind": "vllm"}) as st:
        status, out = await post(st, {"prompt": "alpha beta", "max_tokens": 4, "seed": 42, "temperature": 0.7})
        assert status == 200, out
