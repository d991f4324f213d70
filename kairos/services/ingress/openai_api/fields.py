"""Typed JSON field readers of the OpenAI request validation (no I/O): each returns the value or
raises an :class:`~.responses.ApiError` naming the parameter, as vLLM 0.32's pydantic models do
(``vllm/entrypoints/openai/protocol.py``), with JSON-boolean strictness (``0`` is not ``false``)."""

from __future__ import annotations

import json
import math
from typing import Any

from kairos.contracts.errors import ErrorCode
from kairos.services.ingress.openai_api.responses import ApiError

#: Largest integer accepted in an integer field (int32, as the engines use); above it: out of range.
MAX_INT_FIELD = 2**31 - 1


def same(a: Any, b: Any) -> bool:
    """JSON equality that tells booleans from numbers (``0 != False``, ``1 != True``)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def int_field(body: dict, name: str, default: int | None, lo: int, hi: int = MAX_INT_FIELD) -> int | None:
    """An optional integer in ``[lo, hi]``; null means ``default``.

    An integral JSON number (``3.0``, ``1e2``) is that integer, as vLLM 0.32's pydantic (2.14, lax
    mode) reads ``int`` fields (``int_from_float``); one with a fraction (``3.5``) is a 400
    ``invalid_type``, and so are booleans and strings, which pydantic would coerce (``true`` → 1,
    ``"3"`` → 3) but OpenAI's API refuses (JSON-boolean strictness, module docstring).

    Raises:
        ApiError: 400 ``invalid_type`` / ``invalid_value`` (out of range, below ``lo``) naming ``name``.
    """
    v = body.get(name, default)
    if v is None:
        return default
    if is_number(v) and (v > hi or v < min(lo, -MAX_INT_FIELD - 1)):  # also 1e26 (a JSON float)
        sent = json.dumps(v)  # as the client wrote it (a big integer exactly, not 9.22337e+18)
        raise ApiError(ErrorCode.INVALID_VALUE, f"'{name}' is out of range: {sent} is above the maximum {hi}"
                       if v > 0 else f"'{name}' is out of range: {sent} is below the minimum {min(lo, -MAX_INT_FIELD - 1)}",
                       param=name)
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(ErrorCode.INVALID_TYPE, f"'{name}' must be an integer, got {show(v)}", param=name)
    if v < lo:
        raise ApiError(ErrorCode.INVALID_VALUE, f"'{name}' must be >= {lo}, got {v}", param=name)
    return v


def show(v: Any) -> str:
    """A JSON value for an error message: its JSON type and its (short) JSON text, as the client sent
    it (``boolean true``, ``object {"type": "content"}``, ``string "3"``), cut to 40 characters."""
    kind = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(v), "null" if v is None else type(v).__name__)
    try:
        text = json.dumps(v, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):  # not JSON (a value a caller built, NaN): Python's text
        text = repr(v)
    return f"{kind} {text if len(text) <= 40 else text[:37] + '...'}"


def bool_field(obj: dict, name: str, param: str | None = None) -> bool | None:
    """An optional JSON boolean (``"false"``, ``"no"``, ``1`` are 400s, as in OpenAI's API)."""
    v = obj.get(name)
    if v is None or isinstance(v, bool):
        return v
    param = param or name
    raise ApiError(ErrorCode.INVALID_TYPE,
                   f"'{param}' must be a JSON boolean (true or false), got {show(v)}", param=param)


def number_field(body: dict, name: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    """An optional number in ``[lo, hi]`` (``(lo, hi]`` when ``lo_open``); null means the default."""
    v = body.get(name)
    if v is None:
        return None
    rng = f"between {lo:g} and {hi:g} ({'(' if lo_open else '['}{lo:g}, {hi:g}])"
    if not is_number(v) or not math.isfinite(v):
        raise ApiError(ErrorCode.INVALID_TYPE, f"'{name}' must be a number {rng}, got {show(v)}", param=name)
    if not (lo < v if lo_open else lo <= v) or not v <= hi:
        raise ApiError(ErrorCode.INVALID_VALUE, f"'{name}' must be {rng}, got {v:g}", param=name)
    return float(v)
