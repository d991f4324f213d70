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


def test_run_on_event_loop_returns_the_result_on_the_chosen_loop(monkeypatch):
    from kairos.runtime.service import run_on_event_loop

    async def loop_type() -> type:
        return type(asyncio.get_running_loop())

    monkeypatch.delenv("KAIROS_EVENT_LOOP", raising=False)
    assert issubclass(run_on_event_loop(loop_type(), "test"), uvloop.Loop)
    monkeypatch.setenv("KAIROS_EVENT_LOOP", "asyncio")
    assert not issubclass(run_on_event_loop(loop_type(), "test"), uvloop.Loop)


def test_a_refused_event_loop_closes_the_coroutine_unrun(monkeypatch, capsys):
    from kairos.runtime.service import run_on_event_loop

    ran: list[bool] = []

    async def main() -> None:
        ran.append(True)

    coro = main()
    monkeypatch.setenv("KAIROS_EVENT_LOOP", "trio")
    with pytest.raises(SystemExit):
        run_on_event_loop(coro, "kairos bench")
    assert ran == [] and coro.cr_frame is None  # closed: no "never awaited" warning, nothing ran
    assert "kairos bench: bad configuration: KAIROS_EVENT_LOOP" in capsys.readouterr().err
