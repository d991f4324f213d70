"""kairos.engines.vllm.plugin.general against the real vLLM and NIXL code it patches (the vLLM venv).

Truths: the kernel's CPU accounting of this process (a NIXL agent left idle), libzmq's own socket
options, and vLLM's classes as vLLM builds them. The servers-level effects (idle engines, lost
wake-ups, the forward thread's core) are in tests/vllm/servers/test_pd_servers.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import zmq

from kairos.engines.vllm.plugin import general as plugin

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _idle_agent_cpu_share(delay_us: int | None) -> float:
    """Share of a core a fresh NIXL agent (vLLM's config: num_threads 4) uses over 1.5 s idle, in a
    child process (a NIXL agent's threads live as long as the process)."""
    patch = f"from kairos.engines.vllm.plugin.general import set_nixl_progress_delay; set_nixl_progress_delay({delay_us})" \
        if delay_us is not None else ""
    code = textwrap.dedent(f"""
        import os, time
        {patch}
        import nixl._api as api
        a = api.nixl_agent("kairos-test-%d" % os.getpid(), api.nixl_agent_config(num_threads=4, capture_telemetry=True))
        c0, w0 = time.process_time(), time.monotonic()
        time.sleep(1.5)  # the measurement window
        print((time.process_time() - c0) / (time.monotonic() - w0))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": REPO}, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def test_an_idle_nixl_agent_spins_a_core_and_the_delay_stops_it():
    pytest.importorskip("nixl._api")
    spinning, delayed = _idle_agent_cpu_share(None), _idle_agent_cpu_share(1000)
    # NIXL's own pthrDelay 0: the progress thread spins (a whole core on an idle machine; still a
    # large share when other jobs compete for the cores, hence the ratio); the delay stops it
    assert spinning > 0.25 and spinning > 10 * delayed, (spinning, delayed)
    assert delayed < 0.1  # kairos.engines.vllm.launch.NIXL_PROGRESS_DELAY_US


def test_short_busy_loop_readers_and_a_lossless_writer():
    from vllm.distributed.device_communicators import shm_broadcast as sb

    plugin.set_mq_busy_loop(0.0)
    plugin.set_mq_busy_loop(0.0)  # idempotent: vLLM may load plugins twice in a process
    ctx = zmq.Context()
    addr = f"ipc:///tmp/kairos-spin-{os.getpid()}"
    try:
        writer = sb.SpinCondition(is_reader=False, context=ctx, notify_address=addr)
        reader = sb.SpinCondition(is_reader=True, context=ctx, notify_address=addr)
        assert reader.busy_loop_s == 0.0
        assert writer.local_notify_socket.getsockopt(zmq.SNDHWM) == 0  # vLLM sets 1: drops wake-ups
        assert writer.local_notify_socket.socket_type == zmq.PUB
    finally:
        ctx.destroy(linger=0)


def test_a_bad_busy_loop_setting_is_refused_with_the_variable_named(monkeypatch):
    monkeypatch.setenv(plugin.ENV_MQ_BUSY_LOOP_S, "fast")
    with pytest.raises(ValueError, match=plugin.ENV_MQ_BUSY_LOOP_S):
        plugin.register()
    with pytest.raises(ValueError, match=plugin.ENV_MQ_BUSY_LOOP_S):
        plugin.set_mq_busy_loop(-1.0)
