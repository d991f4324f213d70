"""A JSON body converted into its request model, and msgspec's errors as OpenAI errors (no I/O).

:func:`decode` converts the parsed body with ``msgspec.convert(..., strict=True)``: JSON types are
kept apart (``"3"`` is no integer, ``1`` no boolean: OpenAI's API refuses what pydantic's lax mode
would coerce), except that an integral number in a top-level integer field is that integer
(:func:`integral_ints`: ``3.0`` → 3, as vLLM 0.32's pydantic reads ``int`` fields, ``int_from_float``).
A :class:`msgspec.ValidationError` becomes an :class:`~.responses.ApiError` (:func:`api_error`)
naming the parameter (``param``: the field, or ``messages[i].<field>``, ``stream_options.<field>``,
``response_format.json_schema``) and showing the value as JSON (:func:`~.fields.show`).
"""

from __future__ import annotations

import json
import math
import re
from functools import cache
from typing import Any, TypeVar

import msgspec
from msgspec import inspect as mi

from kairos.contracts.errors import ErrorCode
from kairos.services.ingress.openai_api.fields import show
from kairos.services.ingress.openai_api.models import MAX_INT_FIELD, SEED_MAX, SEED_MIN
from kairos.services.ingress.openai_api.responses import ApiError

T = TypeVar("T")
#: msgspec's error text: ``<what> - at `$.a[0].b``` (no path: the body itself)
_ERROR = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_SEGMENT = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")
#: how many path segments name the parameter, by top-level field (default 1: the field itself)
_PARAM_DEPTH = {"messages": 3, "stream_options": 2}
#: integer bounds that are the field's width (int32, int64): passing one is "out of range"
_WIDTH = (MAX_INT_FIELD, SEED_MAX, SEED_MIN)


@cache
def _int_fields(model: type) -> frozenset[str]:
    """The top-level fields of ``model`` that hold an integer (or null)."""
    out = set()
    for f in mi.type_info(model).fields:  # type: ignore[union-attr]
        t = f.type.type if isinstance(f.type, mi.Metadata) else f.type  # a parameter's annotations (models.P)
        types = t.types if isinstance(t, mi.UnionType) else (t,)
        if any(isinstance(t, mi.IntType) for t in types):
            out.add(f.encode_name)
    return frozenset(out)


def integral(v: Any) -> Any:
    """An integral JSON number as that integer (``2.0`` → 2); anything else as it is."""
    return int(v) if isinstance(v, float) and math.isfinite(v) and v.is_integer() else v


def integral_ints(body: dict[str, Any], model: type) -> dict[str, Any]:
    """``body`` with each integral float of a top-level integer field of ``model`` as that integer
    (a copy only when one changes)."""
    fix = {k: integral(v) for k in _int_fields(model) & body.keys() if isinstance(v := body[k], float)}
    return {**body, **fix} if fix else body


def decode(model: type[T], body: dict[str, Any]) -> T:
    """``body`` (a JSON object) as ``model``.

    Raises:
        ApiError: 400 naming the parameter (:func:`api_error`).
    """
    try:
        return msgspec.convert(integral_ints(body, model), model, strict=True)
    except msgspec.ValidationError as exc:
        raise api_error(str(exc), body, model) from None


def _segments(path: str) -> list[str | int]:
    return [m.group(1) if m.group(1) is not None else (int(m.group(2)) if m.group(2) != "..." else "...")
            for m in _SEGMENT.finditer(path)]


def _param(segs: list[str | int]) -> list[str | int]:
    """The segments that name the parameter (module docstring)."""
    depth = _PARAM_DEPTH.get(str(segs[0]), 1)
    if segs[0] == "response_format" and len(segs) > 1 and segs[1] == "json_schema":
        depth = 2
    return segs[:depth]


def _text(segs: list[str | int]) -> str:
    return "".join(f"[{s}]" if isinstance(s, int) else (s if i == 0 else f".{s}") for i, s in enumerate(segs))


def _value(body: Any, segs: list[str | int]) -> Any:
    for s in segs:
        if isinstance(s, int) and isinstance(body, list) and s < len(body):
            body = body[s]
        elif isinstance(s, str) and isinstance(body, dict):
            body = body.get(s)
        else:
            return None
    return body


def _info(model: type, segs: list[str | int]) -> mi.Type | None:
    """msgspec's type of the field at ``segs`` of ``model`` (None: not found)."""
    t: mi.Type = mi.type_info(model)
    for s in segs:
        nxt = None
        for u in (t.types if isinstance(t, mi.UnionType) else (t,)):
            u = u.type if isinstance(u, mi.Metadata) else u
            if isinstance(s, int) and isinstance(u, mi.ListType):
                nxt = u.item_type
            elif isinstance(u, mi.StructType):
                nxt = next((f.type for f in u.fields if f.encode_name == s), None)
            elif isinstance(u, mi.DictType):
                nxt = u.value_type
            if nxt is not None:
                break
        if nxt is None:
            return None
        t = nxt
    return t


def _range(lo: Any, lo_open: bool, hi: Any) -> str:
    if hi is None:
        return f" {'>' if lo_open else '>='} {lo:g}"
    return f" between {lo:g} and {hi:g} ({'(' if lo_open else '['}{lo:g}, {hi:g}])"


def describe(t: mi.Type | None) -> str:
    """What a field holds, in words (``a number between 0 and 2 ([0, 2])``, ``a list of strings``)."""
    if isinstance(t, mi.Metadata):  # Annotated with schema metadata only
        t = t.type
    if isinstance(t, mi.UnionType):
        return " or ".join(describe(u) for u in t.types if not isinstance(u, mi.NoneType))
    if isinstance(t, mi.IntType):
        lo, hi = (b if b not in _WIDTH else None for b in (t.ge, t.le))
        return "an integer" + (f" between {lo} and {hi}" if lo is not None and hi is not None
                               else f" >= {lo}" if lo is not None else f" <= {hi}" if hi is not None else "")
    if isinstance(t, mi.FloatType):
        lo, lo_open = (t.gt, True) if t.gt is not None else (t.ge, False)
        return "a number" + (_range(lo, lo_open, t.le) if lo is not None else "")
    if isinstance(t, mi.BoolType):
        return "a JSON boolean (true or false)"
    if isinstance(t, mi.StrType):
        return "a string"
    if isinstance(t, mi.LiteralType):
        return "one of " + ", ".join(json.dumps(v) for v in t.values)
    if isinstance(t, mi.ListType):
        item = describe(t.item_type)
        return "a list of " + (item.split(" ", 1)[1] + "s" if item.startswith(("a ", "an ")) else item)
    if isinstance(t, mi.DictType):
        return f"an object of {describe(t.value_type).split(' ', 1)[-1]} values"
    return "an object" if isinstance(t, (mi.StructType, mi.DictType)) else "a JSON value"


def api_error(error: str, body: dict[str, Any], model: type) -> ApiError:
    """msgspec's ``error`` text (a conversion of ``body`` into ``model``) as a 400 naming the parameter.

    Codes: a missing field ``missing_required_parameter``; a wrong JSON type ``invalid_type``; a
    value outside its bounds, length or values, or an unknown field of an object in the body
    ``invalid_value``; an unknown field of the body itself ``unknown_parameter``.
    """
    m = _ERROR.match(error)
    what, segs = (m.group("what"), _segments(m.group("path") or "")) if m else (error, [])
    if what.startswith(("Object missing required field", "Object contains unknown field")):
        field = what.split("`")[1]
        segs = [*segs, field]
        if what.startswith("Object missing"):
            p = _param(segs)
            return ApiError(ErrorCode.MISSING_REQUIRED_PARAMETER, f"'{_text(segs)}' is required", param=_text(p))
        if len(segs) == 1:  # a parameter the endpoint does not have
            return ApiError(ErrorCode.UNKNOWN_PARAMETER, f"Unrecognized request argument supplied: {field}",
                            param=field)
        container = _text(segs[:-1])
        return ApiError(ErrorCode.INVALID_VALUE, f"'{container}' has an unsupported field {field!r}",
                        param=_text(_param(segs)))
    if not segs:
        return ApiError(ErrorCode.INVALID_VALUE, error)
    p = _param(segs)
    name, value = _text(p), _value(body, p)
    expected = describe(_info(model, p))
    if ", got `" in what:
        return ApiError(ErrorCode.INVALID_TYPE, f"'{name}' must be {expected}, got {show(value)}", param=name)
    bound = re.search(r"`(?:int|float)` ([<>]=?) (\S+)$", what)
    if bound and what.startswith("Expected `int`") and int(bound.group(2)) in _WIDTH:
        side = "above the maximum" if bound.group(1).startswith("<") else "below the minimum"
        sent = json.dumps(_value(body, segs))  # as the client wrote it (1e+26, a big integer exactly)
        return ApiError(ErrorCode.INVALID_VALUE, f"'{name}' is out of range: {sent} is {side} {bound.group(2)}",
                        param=name)
    length = re.search(r"of length ([<>]=?) (\d+)$", what)
    if length and length.group(1) == ">=" and length.group(2) == "1":
        return ApiError(ErrorCode.INVALID_VALUE, f"'{_text(segs)}' must not be empty", param=name)
    if length:
        return ApiError(ErrorCode.INVALID_VALUE, f"'{_text(segs)}' has {len(_value(body, segs))} items; at most "
                                                 f"{length.group(2)} are allowed", param=name)
    if _text(segs) != name:
        expected = describe(_info(model, segs))
        name = _text(segs)
    return ApiError(ErrorCode.INVALID_VALUE, f"'{name}' must be {expected}, got {show(_value(body, segs))}",
                    param=_text(p))
