"""Ports for servers started later (``kairos.cli.processes.free_port`` / ``free_port_block``): outside
the kernel's ephemeral range, so no process's outgoing connection takes one before its server binds
it (a cold CI run lost a vLLM test module to ``Address already in use`` on a NIXL handshake port the
kernel had chosen), never handed out twice, and a UCX range whose every port is free and kept."""

from __future__ import annotations

import socket

import pytest

from kairos.cli import processes
from kairos.cli.processes import free_port, free_port_block, listener_port_range, reserve_port


def _ephemeral() -> tuple[int, int]:
    low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    return low, high


def test_ports_are_outside_the_ephemeral_range_that_outgoing_connections_draw_from():
    low, high = _ephemeral()
    lo, hi = listener_port_range()
    assert hi - lo >= 1000 and (hi <= low or lo > high)
    ports = [free_port() for _ in range(200)]
    assert all(not (low <= p <= high) for p in ports), [p for p in ports if low <= p <= high]
    # the independent truth: what the kernel gives an outgoing connection lies in the range we avoid
    with socket.socket() as srv, socket.socket() as cli:
        srv.bind(("127.0.0.1", ports[0]))
        srv.listen()
        cli.connect(("127.0.0.1", ports[0]))
        assert low <= cli.getsockname()[1] <= high


def test_never_the_same_port_twice_nor_a_reserved_one(monkeypatch):
    monkeypatch.setattr(processes, "_TAKEN", set())
    monkeypatch.setattr(processes, "listener_port_range", lambda: (31000, 31010))
    reserve_port(31004)
    # a port another process of this machine holds right now is not free either (a cold CI run once
    # had one of these busy): what free_port owes is every other port of the range, once each
    want = {p for p in range(31000, 31010) if p != 31004 and _bindable(p)}
    assert {free_port() for _ in range(len(want))} == want
    with pytest.raises(RuntimeError, match="no 1 free consecutive ports"):
        free_port()


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_a_block_is_free_end_to_end_and_kept(monkeypatch):
    monkeypatch.setattr(processes, "_TAKEN", set())
    monkeypatch.setattr(processes, "listener_port_range", lambda: (31100, 31150))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 31120))  # a listener of someone else in the middle of the range
        start = free_port_block(21)
        block = set(range(start, start + 21))
        assert 31120 not in block and block <= set(range(31121, 31150))
        assert block <= processes._TAKEN
        with pytest.raises(RuntimeError):  # no second block of 21 fits beside the first and the busy port
            free_port_block(21)


def test_a_block_of_no_ports_is_refused():
    with pytest.raises(ValueError, match="n must be >= 1"):
        free_port_block(0)
