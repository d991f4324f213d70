"""Contract C: SamplingParams travels on InferenceRequest; sampling_body() gives vLLM body fields."""

from kairos.contracts.events import DoneEvent
from kairos.contracts.wire import decode, encode, InferenceRequest, sampling_body, SamplingParams


def _req(**kw) -> InferenceRequest:
    return InferenceRequest(request_id="cmpl-1", model="m", prompt_tokens=3, max_tokens=4,
                            created_unix_ms=1.0, deadline_unix_ms=2.0, **kw)


def test_sampling_round_trips_on_the_bus():
    sp = SamplingParams(temperature=0.0, seed=7, stop=["dolor"], stop_token_ids=[5], min_tokens=2,
                        ignore_eos=True, logit_bias={"12": -100.0}, include_stop_str_in_output=False)
    back = decode(encode(_req(sampling=sp)), InferenceRequest)
    assert back.sampling == sp


def test_default_sampling_is_omitted_and_old_bodies_decode():
    body = encode(_req())
    assert b'"sampling":{}' in body  # defaults omitted inside
    old = body.replace(b',"sampling":{}', b"")  # a body from before contract C
    assert b"sampling" not in old
    assert decode(old, InferenceRequest).sampling == SamplingParams()
    assert b"temperature" not in encode(SamplingParams(seed=1))


def test_sampling_body_has_only_the_set_fields_with_vllm_names():
    sp = SamplingParams(temperature=0.0, top_k=5, stop=["x"], ignore_eos=False)
    assert sampling_body(sp) == {"temperature": 0.0, "top_k": 5, "stop": ["x"], "ignore_eos": False}
    assert sampling_body(SamplingParams()) == {}


def test_done_event_carries_finish_reason_and_cached_tokens():
    ev = DoneEvent(request_id="r", completion_tokens=3, finish_reason="stop", cached_tokens=16,
                   node="d0", sent_unix_ms=1.0)
    back = decode(encode(ev), DoneEvent)
    assert (back.finish_reason, back.cached_tokens) == ("stop", 16)
    assert decode(encode(DoneEvent(request_id="r", completion_tokens=1, node="d0", sent_unix_ms=1.0)),
                  DoneEvent).cached_tokens == 0
