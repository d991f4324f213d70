"""JSON values in the request validation's messages and comparisons (no I/O): :func:`show` writes a
value as the client sent it, :func:`same` compares as JSON does (``0`` is not ``false``)."""

from __future__ import annotations

import json
from typing import Any


def same(a: Any, b: Any) -> bool:
    """JSON equality that tells booleans from numbers (``0 != False``, ``1 != True``)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def show(v: Any) -> str:
    """A JSON value for an error message: its JSON type and its (short) JSON text, as the client sent
    it (``boolean true``, ``object {"type": "content"}``, ``string "3"``; null: ``null``), cut to 40
    characters."""
    if v is None:
        return "null"
    kind = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(v), type(v).__name__)
    try:
        text = json.dumps(v, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):  # not JSON (a value a caller built, NaN): Python's text
        text = repr(v)
    return f"{kind} {text if len(text) <= 40 else text[:37] + '...'}"
