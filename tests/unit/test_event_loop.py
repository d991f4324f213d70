"""The services' event loop choice (kairos/runtime/service.py ``serve``, ``KAIROS_EVENT_LOOP``)."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from kairos.runtime.service import serve


def _loop_class(monkeypatch, value: str | None) -> type:
    if value is None:
        monkeypatch.delenv("KAIROS_EVENT_LOOP", raising=False)
    else:
        monkeypatch.setenv("KAIROS_EVENT_LOOP", value)
    seen: list[type] = []

    async def run(config, stop) -> None:
        assert config == "cfg"
        seen.append(type(asyncio.get_running_loop()))
    serve(run, "cfg", "test")
    return seen[0]


def test_uvloop_by_default_and_asyncio_on_request(monkeypatch):
    assert issubclass(_loop_class(monkeypatch, None), uvloop.Loop)
    assert issubclass(_loop_class(monkeypatch, "uvloop"), uvloop.Loop)
    plain = _loop_class(monkeypatch, "asyncio")
    assert not issubclass(plain, uvloop.Loop) and issubclass(plain, asyncio.BaseEventLoop)


def test_unknown_event_loop_is_a_configuration_error(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exc:
        _loop_class(monkeypatch, "trio")
    assert exc.value.code == 2
    assert "KAIROS_EVENT_LOOP" in capsys.readouterr().err
