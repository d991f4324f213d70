"""The error-code catalogue (kairos.contracts.errors.ErrorCode) is the one the wire, the HTTP layer and
docs/errors.md use: every code the source sends is in it, it round-trips on the wire, and an unknown code
is refused naming the field."""

import ast
from pathlib import Path

import msgspec
import pytest

from kairos.contracts import events as E
from kairos.contracts import wire as W
from kairos.contracts.errors import PROTOCOL_CODES, ErrorCode, error_type_for

ROOT = Path(__file__).resolve().parents[2]


def event(code) -> E.ErrorEvent:
    return E.ErrorEvent(request_id="r", status=503, code=code, message="m", source="s", sent_unix_ms=1.0)


@pytest.mark.parametrize("code", list(ErrorCode))
def test_every_code_round_trips_on_the_wire_as_its_plain_string(code):
    body = W.encode(event(code))
    assert f'"code":"{code.value}"'.encode() in body
    back = W.decode(body, E.ErrorEvent)
    assert back.code is code and back.code.status == code.status


def test_an_unknown_code_is_refused_naming_the_field():
    body = msgspec.json.encode({"tag": "error", "request_id": "r", "status": 503, "code": "no_such_code",
                                "message": "m", "source": "s", "sent_unix_ms": 1.0})
    with pytest.raises(W.WireError, match=r"\$\.code"):
        W.decode(body, E.ErrorEvent)


def test_statuses_types_and_retry_follow_openai():
    assert ErrorCode.MODEL_NOT_FOUND.status == 404 and error_type_for(404) == "not_found_error"
    assert ErrorCode.OVERLOADED.retry and ErrorCode.NO_AVAILABLE_NODE.retry and not ErrorCode.TIMEOUT.retry
    assert error_type_for(503) == "service_unavailable" and error_type_for(500) == "server_error"
    assert error_type_for(400) == "invalid_request_error" and error_type_for(429) == "rate_limit_error"
    assert all(code.status == status for status, code in PROTOCOL_CODES.items())
    assert len({c.value for c in ErrorCode}) == len(ErrorCode)  # no alias hides a second meaning


def sent_codes(root: Path) -> list[tuple[str, int, str]]:
    """Every string literal passed as ``code=`` anywhere in the package (file, line, code)."""
    found = []
    for path in sorted((root / "kairos").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                for kw in node.keywords:
                    if kw.arg == "code" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
                        found.append((str(path.relative_to(root)), node.lineno, kw.value.value))
    return found


def test_every_code_literal_the_source_sends_is_in_the_catalogue(tmp_path):
    codes = {c.value for c in ErrorCode}
    stray = [f"{f}:{line}: {c!r}" for f, line, c in sent_codes(ROOT) if c not in codes]
    assert not stray, "error codes missing from kairos/contracts/errors.py:\n" + "\n".join(stray)
    # the scan sees a planted stray code
    (tmp_path / "kairos").mkdir()
    (tmp_path / "kairos" / "x.py").write_text("raise ApiError(400, 'm', code='made_up')\n")
    assert sent_codes(tmp_path) == [("kairos/x.py", 1, "made_up")]
