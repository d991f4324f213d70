"""The emulated engine's deterministic output and vLLM's stop rules (kairos/core/engine_model/text.py).

The truth each test checks against is the *unconstrained* output of the same request (no stop
conditions), computed independently of the stop logic: a stop rule must cut that sequence exactly
where vLLM's rules say.
"""

import pytest

from kairos.core.engine_model.text import (EOS_TOKEN_ID, NATURAL_LENGTH_MAX, NATURAL_LENGTH_MIN, EmulatedCompletion,
                                  emulated_completion, natural_length, sequence_key, token_text)
from kairos.contracts.wire import SamplingParams as SP


def free(seed=7, n=200, prompt="hello"):
    """The unconstrained output (ids, per-token texts) of a seeded request."""
    c = emulated_completion(SP(seed=seed), n, prompt, None)
    assert (c.n_tokens, c.finish_reason) == (n, "length")
    ids = [c.token_id(i) for i in range(n)]
    return ids, [token_text(t) for t in ids]


def test_text_is_a_function_of_seed_or_prompt():
    a = emulated_completion(SP(seed=1), 30, "p", None).full_text()
    assert a == emulated_completion(SP(seed=1), 30, "other prompt", None).full_text()  # seed decides
    assert a != emulated_completion(SP(seed=2), 30, "p", None).full_text()
    no_seed = emulated_completion(SP(), 30, "p", None).full_text()
    assert no_seed == emulated_completion(SP(), 30, "p", None).full_text()
    assert no_seed != emulated_completion(SP(), 30, "q", None).full_text()
    assert emulated_completion(SP(), 30, None, [1, 2]).full_text() != emulated_completion(SP(), 30, None, [1, 3]).full_text()
    # greedy ignores the seed, like a real model
    assert sequence_key(SP(seed=1, temperature=0.0), "p", None) == sequence_key(SP(seed=2, temperature=0.0), "p", None)
    assert sequence_key(SP(seed=1, temperature=0.7), "p", None) != sequence_key(SP(seed=2, temperature=0.7), "p", None)


def test_tokens_come_from_the_fixed_vocabulary():
    ids, texts = free(n=500)
    assert all(3 <= t < 32000 for t in ids)
    assert len(set(ids)) > 400  # spread over the vocabulary
    assert all(t.startswith(" ") and t.strip() for t in texts)


def test_max_tokens_gives_length():
    c = emulated_completion(SP(seed=3), 5, "x", None)
    assert (c.n_tokens, c.finish_reason, c.stop_reason) == (5, "length", None)
    assert len(c.full_text().split()) == 5


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_at_the_first_match(include):
    ids, texts = free()
    stop = texts[9].strip()  # a word that certainly occurs
    full = "".join(texts)
    at = full.find(stop)
    assert at >= 0
    c = emulated_completion(SP(seed=7, stop=[stop], include_stop_str_in_output=include), 200, "hello", None)
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.full_text() == full[:at + (len(stop) if include else 0)]
    ends = [sum(map(len, texts[:i + 1])) for i in range(len(texts))]
    assert c.n_tokens == next(i for i, e in enumerate(ends) if e >= at + len(stop)) + 1
    assert "".join(c.text(i) for i in range(c.n_tokens)) == c.full_text()


def test_stop_string_spanning_tokens_shortens_earlier_deltas():
    ids, texts = free()
    stop = texts[4][-2:] + texts[5][:3]  # straddles tokens 4 and 5
    full = "".join(texts)
    at = full.find(stop)
    c = emulated_completion(SP(seed=7, stop=[stop]), 200, "hello", None)
    assert c.full_text() == full[:at]
    assert c.n_tokens <= 6 and c.finish_reason == "stop"


def test_stop_list_order_wins_like_vllm():
    """Two stop strings completed by the same token: vLLM takes the first *in the list*, not the earliest."""
    ids, texts = free()
    full = "".join(texts)
    k = next(k for k, t in enumerate(texts) if len(t) >= 6 and full.find(t[1:4]) == sum(map(len, texts[:k])) + 1
             and full.find(t[3:]) == sum(map(len, texts[:k])) + 3)
    late, early = texts[k][3:], texts[k][1:4]  # `early` starts 2 chars before `late`
    c = emulated_completion(SP(seed=7, stop=[late, early]), 200, "hello", None)
    assert (c.stop_reason, c.n_tokens) == (late, k + 1)
    assert c.full_text() == full[:full.find(late)]


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_id_ends_with_stop_and_counts_the_token(include):
    ids, texts = free()
    target = ids[5]
    first = ids.index(target)
    c = emulated_completion(SP(seed=7, stop_token_ids=[target], include_stop_str_in_output=include), 200,
                            "hello", None)
    assert (c.n_tokens, c.finish_reason, c.stop_reason) == (first + 1, "stop", target)
    assert c.full_text() == "".join(texts[:first]) + (texts[first] if include else "")


def test_min_tokens_masks_stop_ids_and_delays_stop_strings():
    ids, texts = free()
    c = emulated_completion(SP(seed=7, stop_token_ids=[ids[2]], min_tokens=5), 200, "hello", None)
    assert c.token_id(2) != ids[2]  # re-drawn: masked before min_tokens
    assert c.n_tokens >= 6 or c.finish_reason == "length"
    stop = texts[1].strip()
    c = emulated_completion(SP(seed=7, stop=[stop], min_tokens=10), 200, "hello", None)
    assert c.n_tokens > 10
    assert c.full_text().startswith("".join(texts[:10]))


def test_natural_ending_only_when_asked_and_not_ignore_eos():
    key = sequence_key(SP(), "hi", None)
    n = natural_length(key)
    assert NATURAL_LENGTH_MIN <= n <= NATURAL_LENGTH_MAX
    c = emulated_completion(SP(), 4000, "hi", None, natural_end=True)
    assert (c.n_tokens, c.finish_reason, c.token_id(n - 1)) == (n, "stop", EOS_TOKEN_ID)
    assert len(c.full_text().split()) == n - 1  # EOS has no text
    # explicit max_tokens (replays): never an early EOS
    assert emulated_completion(SP(), 4000, "hi", None).n_tokens == 4000
    assert emulated_completion(SP(ignore_eos=True), 4000, "hi", None, natural_end=True).n_tokens == 4000
    # min_tokens pushes the EOS out; a small max_tokens comes first
    assert emulated_completion(SP(min_tokens=n + 10), 4000, "hi", None, natural_end=True).n_tokens == n + 11
    assert emulated_completion(SP(), n - 1, "hi", None, natural_end=True).finish_reason == "length"
    shown = emulated_completion(SP(skip_special_tokens=False, include_stop_str_in_output=True), 4000, "hi", None,
                                natural_end=True)
    assert shown.full_text().endswith("</s>")


def test_logit_bias_minus_100_bans_an_id():
    ids, _ = free()
    c = EmulatedCompletion(SP(seed=7, logit_bias={str(ids[0]): -100}), 200, sequence_key(SP(seed=7), "", None))
    assert ids[0] not in {c.token_id(i) for i in range(200)}
    assert c.token_id(1) == ids[1]  # others unchanged
    banned_eos = emulated_completion(SP(logit_bias={"2": -100}), 4000, "hi", None, natural_end=True)
    assert (banned_eos.n_tokens, banned_eos.finish_reason) == (4000, "length")


def test_bad_arguments_raise():
    with pytest.raises(ValueError):
        EmulatedCompletion(SP(), 0, 1)
    with pytest.raises(ValueError):
        token_text(-1)


@pytest.mark.parametrize("offset", [1, 5, 11, 12, 13])
def test_a_resumed_request_continues_the_original_output_exactly(offset):
    """Issue 33: a migrated request resumes after ``offset`` tokens with what the original would have
    produced there — the same ids and texts, the same end — also when a stop string straddles the
    boundary (its cut was planned on the whole text): the prefix plus the rest is the original."""
    from kairos.core.engine_model.text import ResumedCompletion

    ids, texts = free(n=40)
    stop = texts[12] + texts[13]  # spans tokens 12 and 13: the match completes at token 13
    full = emulated_completion(SP(seed=7, stop=[stop.strip()]), 40, "hello", None)
    assert full.finish_reason == "stop" and full.n_tokens == 14
    rest = ResumedCompletion(full, offset)
    assert rest.n_tokens == 14 - offset and (rest.finish_reason, rest.stop_reason) == ("stop", stop.strip())
    assert "".join(full.text(i) for i in range(offset)) + "".join(rest.text(i) for i in range(rest.n_tokens)) \
        == full.full_text()
    assert [rest.token_id(i) for i in range(rest.n_tokens)] == ids[offset:14]
    with pytest.raises(ValueError, match="cannot resume after 14 output tokens: the output has 14"):
        ResumedCompletion(full, 14)  # the original ended there
