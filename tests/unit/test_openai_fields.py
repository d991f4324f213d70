"""The typed fields of the request validation (kairos/services/ingress/openai_api/decode.py, fields.py):
error messages show values as JSON (not Python reprs), and integer fields read integral numbers as
vLLM 0.32's pydantic 2.14 does in lax mode (``int_from_float``: ``3.0`` → 3, ``3.5`` refused; checked
with ``CompletionRequest``-like ``max_tokens: int | None`` in the vLLM venv: 3.0→3, 1e2→100, -0.0→0,
3.5 → "got a number with a fractional part"). Booleans stay refused (pydantic would read ``true`` as 1)."""

from __future__ import annotations

import pytest

from kairos.services.ingress import openai_api as oa
from kairos.services.ingress.openai_api.fields import show


def parse(body: dict, endpoint: oa.Endpoint = "completions") -> oa.ParsedRequest:
    return oa.parse_request(endpoint, {"model": "m", "prompt": "x", **body}, ["m"])


def refused(body: dict) -> oa.ApiError:
    with pytest.raises(oa.ApiError) as ei:
        parse(body)
    return ei.value


@pytest.mark.parametrize("value,text", [
    (True, "boolean true"), (False, "boolean false"), (None, "null"), ("3", 'string "3"'),
    ({"type": "content"}, 'object {"type": "content"}'), ([1, "a"], 'array [1, "a"]'), (2.5, "number 2.5"),
    ("x" * 50, 'string "' + "x" * 36 + "..."), ("é", 'string "é"'),
])
def test_values_are_shown_as_json(value, text):
    assert show(value) == text


def test_an_error_message_shows_json_not_a_python_repr():
    e = refused({"echo": {"type": "content"}})
    assert e.param == "echo" and 'got object {"type": "content"}' in e.message, e.message
    e = refused({"max_tokens": True})
    assert e.param == "max_tokens" and e.code == "invalid_type" and "got boolean true" in e.message, e.message


@pytest.mark.parametrize("value,expected", [(3.0, 3), (1e2, 100), (3.0000000000000001, 3)])
def test_integral_numbers_are_integers(value, expected):
    out = parse({"max_tokens": value, "n": 2.0, "seed": 7.0, "top_k": 5.0, "min_tokens": 1.0})
    assert out.max_tokens == expected and type(out.max_tokens) is int
    assert out.n == 2 and out.sampling.seed == 7 and out.sampling.top_k == 5 and out.sampling.min_tokens == 1
    assert type(out.n) is int and type(out.sampling.seed) is int


@pytest.mark.parametrize("value", [3.5, True, "3", float("inf")])
def test_fractions_booleans_and_strings_stay_refused(value):
    e = refused({"max_tokens": value})
    assert e.param == "max_tokens" and e.code in ("invalid_type", "invalid_value"), e.message
