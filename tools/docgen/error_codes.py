"""The ``error-codes`` block of docs/errors.md: the error-code catalogue rendered from
:class:`kairos.contracts.errors.ErrorCode` (code, HTTP status, OpenAI ``type``, retry, when sent)."""

from __future__ import annotations

from typing import Any

from kairos.contracts.errors import ErrorCode, error_type_for


def error_codes(load: Any = None) -> str:
    """Markdown table of every :class:`ErrorCode`, in status order then catalogue order.

    ``load`` (the result loader every renderer takes) is unused: the source is the code itself.
    """
    rows = sorted(ErrorCode, key=lambda c: (c.status, list(ErrorCode).index(c)))
    lines = ["| code | HTTP status | OpenAI `type` | retry may succeed | when |", "|---|---|---|---|---|"]
    lines += [f"| `{c.value}` | {c.status} | `{error_type_for(c.status)}` | {'yes' if c.retry else 'no'} | {c.doc} |"
              for c in rows]
    return "\n".join(lines)
