"""A JSON body converted into its request model, and msgspec's errors as OpenAI errors (no I/O).

:func:`decode` converts the parsed body with ``msgspec.convert(..., strict=True)``: JSON types are
kept apart (``"3"`` is no integer, ``1`` no boolean: OpenAI's API refuses what pydantic's lax mode
would coerce), except that an integral number in a top-level integer field is that integer
(:func:`integral_ints`: ``3.0`` → 3, as vLLM 0.32's pydantic reads ``int`` fields, ``int_from_float``).
A :class:`msgspec.ValidationError` becomes an :class:`~.responses.ApiError` (:func:`api_error`): msgspec's
own text (``Expected `float | null`, got `str` - at `$.temperature```) in words, naming the full path
and the value sent there as JSON (:func:`~.fields.show`), with what the text leaves out from the model
(an enum's values, a range's other end); ``param`` names the field, or ``messages[i].<field>``,
``stream_options.<field>``, ``response_format.json_schema``.
"""

from __future__ import annotations

import json
import math
import re
from functools import cache, reduce
from typing import Any, TypeVar

import msgspec
from msgspec import inspect as mi

from kairos.contracts.errors import ErrorCode
from kairos.services.ingress.openai_api.fields import show
from kairos.services.ingress.openai_api.models import MAX_INT_FIELD, SEED_MAX, SEED_MIN
from kairos.services.ingress.openai_api.responses import ApiError

T = TypeVar("T")
#: msgspec's error text: ``<what> - at `$.a[0].b``` (no path: the body itself); a path's segments
_ERROR, _SEGMENT = re.compile(r"^(.*?)(?: - at `\$([^`]*)`)?$", re.S), re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")
#: msgspec's JSON type names in words
_WORDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "a JSON boolean (true or false)",
          "array": "an array", "object": "an object", "null": "null"}
#: how many path segments name the parameter, by top-level field (default 1: the field itself)
_PARAM_DEPTH = {"messages": 3, "stream_options": 2}
#: integer bounds that are the field's width (int32, int64): passing one is "out of range"
_WIDTH = (MAX_INT_FIELD, SEED_MAX, SEED_MIN)
_info = cache(mi.type_info)  # a model's type tree (a struct: its fields), 0.6 ms to build


def _is_int(t: Any) -> bool:
    return isinstance(t, mi.IntType)


def _is_int_list(t: Any) -> bool:
    return isinstance(t, mi.ListType) and isinstance(t.item_type, mi.IntType)


@cache
def _fields_holding(model: type, holds: Any) -> frozenset[str]:
    """The top-level fields of ``model`` one of whose types (null aside) ``holds(type)`` accepts: an
    integer (:func:`_is_int`), a list of integers (:func:`_is_int_list`); ``holds`` a module function
    (the cache's key)."""
    return frozenset(f.encode_name for f in _info(model).fields  # type: ignore[union-attr]
                     if any(holds(t) for t in _types(model, [f.encode_name])))


def integral(v: Any) -> Any:
    """An integral JSON number as that integer (``2.0`` → 2); anything else as it is."""
    return int(v) if isinstance(v, float) and math.isfinite(v) and v.is_integer() else v


def integral_ints(body: dict[str, Any], model: type) -> dict[str, Any]:
    """``body`` with each integral float of a top-level integer field of ``model`` as that integer
    (a copy only when one changes)."""
    fix = {k: integral(v) for k in _fields_holding(model, _is_int) & body.keys() if isinstance(v := body[k], float)}
    return {**body, **fix} if fix else body


def decode(model: type[T], body: dict[str, Any]) -> T:
    """``body`` (a JSON object) as ``model``; an integral number in an integer field or among the items
    of a top-level integer list (``stop_token_ids``, ``tokens``) is that integer (the items are looked
    at only when the body does not convert as it is: the common body pays nothing).

    Raises:
        ApiError: 400 naming the parameter (:func:`api_error`).
    """
    fixed = integral_ints(body, model)
    try:
        return msgspec.convert(fixed, model, strict=True)
    except msgspec.ValidationError as exc:
        error = exc
    lists = {k: [integral(t) for t in v] for k in _fields_holding(model, _is_int_list) & fixed.keys()
             if isinstance(v := fixed[k], list) and any(isinstance(t, float) for t in v)}
    if lists:
        try:
            return msgspec.convert({**fixed, **lists}, model, strict=True)
        except msgspec.ValidationError as exc:
            error = exc
    raise api_error(str(error), body, model) from None


def _text(segs: list[str | int]) -> str:
    """msgspec's path without its ``$.``: ``messages[0].content``, ``logit_bias[...]``."""
    return "".join(s if not i else f".{s}" if isinstance(s, str) and s != "..." else f"[{s}]"
                   for i, s in enumerate(segs))


def _param(segs: list[str | int]) -> str:
    """The parameter ``segs`` is in (module docstring)."""
    return _text(segs[:2 if segs[:2] == ["response_format", "json_schema"] else _PARAM_DEPTH.get(str(segs[0]), 1)])


def _words(types: str, plural: bool = False) -> str:
    """msgspec's ``int | null`` in words: ``an integer or null`` (plural: ``integers or null``)."""
    w = [_WORDS.get(t, f"`{t}`") for t in types.split(" | ")]
    text = ", ".join(w[:-1]) + " or " + w[-1] if len(w) > 1 else w[0]
    return re.sub(r"\ban? (JSON )?(\w+)", r"\1\2s", text) if plural else text


def _types(model: type, segs: list[str | int]) -> list[Any]:
    """msgspec's types at ``segs`` of ``model``, for what its text leaves out: enum values, a range's other end."""
    def flat(t: Any) -> list[Any]:
        t = t.type if isinstance(t, mi.Metadata) else t
        return [u for m in t.types for u in flat(m)] if isinstance(t, mi.UnionType) else [t]
    ts = flat(_info(model))
    for s in segs:  # into an array's items, an object's values, a struct's field s
        nxt = [[t.item_type] if isinstance(t, mi.ListType) else [t.value_type] if isinstance(t, mi.DictType)
               else [f.type for f in getattr(t, "fields", ()) if f.encode_name == s] for t in ts]
        ts = [u for n in nxt for t in n for u in flat(t)]
    return ts


def api_error(error: str, body: dict[str, Any], model: type) -> ApiError:
    """msgspec's ``error`` text (a conversion of ``body`` into ``model``) as a 400 naming the parameter.

    Codes: a missing field ``missing_required_parameter``; a wrong JSON type ``invalid_type``; a
    value outside its bounds, length or values, or an unknown field of an object in the body
    ``invalid_value``; an unknown field of the body itself ``unknown_parameter``.
    """
    what, path = _ERROR.match(error).groups()  # type: ignore[union-attr]
    segs: list = [m[1] or (int(m[2]) if m[2].isdigit() else m[2]) for m in _SEGMENT.finditer(path or "")]
    code = ErrorCode.INVALID_VALUE
    if f := re.fullmatch(r"Object (missing required|contains unknown) field `(.*)`", what, re.S):
        segs = [*segs, f[2]]
        if f[1].startswith("missing"):
            return ApiError(ErrorCode.MISSING_REQUIRED_PARAMETER, f"'{_text(segs)}' is required", param=_param(segs))
        if len(segs) == 1:  # a parameter the endpoint does not have
            return ApiError(ErrorCode.UNKNOWN_PARAMETER, f"Unrecognized request argument supplied: {f[2]}", param=f[2])
        return ApiError(code, f"'{_text(segs[:-1])}' has an unsupported field {f[2]!r}", param=_param(segs))
    if not segs:
        return ApiError(code, error)
    name, param = _text(segs), _param(segs)
    value = reduce(lambda v, s: v[s], segs, body) if "..." not in segs else None  # [...]: an object's value
    got = show(value) if "..." not in segs else None
    bound = re.fullmatch(r"Expected `(int|float)` ([<>]=?) (\S+)", what)
    if bound and bound[1] == "int" and int(bound[3]) in _WIDTH:  # the value as the client wrote it: 1e+26
        side = "above the maximum" if bound[2][0] == "<" else "below the minimum"
        return ApiError(code, f"'{name}' is out of range: {json.dumps(value)} is {side} {bound[3]}", param=param)
    if (n := re.fullmatch(r"Expected `\w+` of length ([<>]=) (\d+)", what)) and (
            n[1] == ">=" and n[2] == "1" or n[1] == "<=" and isinstance(value, list)):
        return ApiError(code, f"'{name}' must not be empty" if n[1] == ">=" else
                        f"'{name}' has {len(value)} items; at most {n[2]} are allowed", param=param)
    expected = re.sub(r"^Expected `([^`]+)`", lambda e: _words(e[1]), what)  # "a number > 0.0", or msgspec's text
    if t := re.fullmatch(r"Expected `([^`]+)`, got `(\w+)`", what):
        code, expected = ErrorCode.INVALID_TYPE, _words(t[1])
        got = got or _WORDS.get(t[2], t[2]).split(" (")[0]  # not located: what msgspec got ("a string")
        if isinstance(segs[-1], int) or segs[-1] == "...":  # an array's item, an object's value
            items, parent = _words(t[1], plural=True), _text(segs[:-1])
            return ApiError(code, f"'{parent}' values must be {items}, got {got}" if segs[-1] == "..." else
                            f"'{parent}' must be a list of {items}: '{name}' is {got}", param=param)
    elif what.startswith("Invalid enum value"):
        values = [v for u in _types(model, segs) if isinstance(u, mi.LiteralType) for v in u.values]
        expected = "one of " + ", ".join(map(json.dumps, values)) if values else what
    elif bound and (num := [u for u in _types(model, segs) if isinstance(u, (mi.IntType, mi.FloatType))]):
        lo, hi = num[0].gt if num[0].ge is None else num[0].ge, num[0].le
        if lo is not None and hi is not None and lo not in _WIDTH and hi not in _WIDTH:  # both ends of a range
            expected = f"an integer between {lo} and {hi}" if bound[1] == "int" else \
                f"a number between {lo:g} and {hi:g} ({'(' if num[0].ge is None else '['}{lo:g}, {hi:g}])"
    verb = "must be" if expected != what else "is invalid:"  # a text of msgspec's not read here
    return ApiError(code, f"'{name}' {verb} {expected}" + (f", got {got}" if got else ""), param=param)
