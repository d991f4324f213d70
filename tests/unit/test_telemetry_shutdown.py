"""A service stopping while its trace collector is unreachable exits within 5 s (it took 17.8 s:
the OTLP exporter retried with backoff and the SDK waited for it).

Real processes: the child exports to a closed local port or an unroutable address, records the
monotonic time just before ``Telemetry.shutdown()``, and the parent notes when it has exited
(CLOCK_MONOTONIC is system-wide on Linux), so interpreter teardown (atexit hooks) counts too.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import sys, time
from kairos.runtime import telemetry
tel = telemetry.setup("ingress", "shutdown-test", log_format="json")
for _ in range(50):
    with tel.tracer.start_as_current_span("work"):
        pass
print(time.monotonic(), flush=True)
ok = tel.shutdown()
print("flushed" if ok else "abandoned", flush=True)
"""


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("endpoint", [closed_port(), "http://192.0.2.1:4318"], ids=["closed-port", "unroutable"])
def test_shutdown_with_unreachable_collector_is_bounded(endpoint):
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_TIMEOUT": "10000",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", CHILD], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    exited = time.monotonic()
    assert proc.returncode == 0, err
    lines = out.split()
    started = float(lines[0])
    assert exited - started <= 5.0, (exited - started, lines, err[-500:])
    assert lines[1] == "abandoned"  # nothing could be exported, and it was said
    assert "span_export_abandoned" in err
