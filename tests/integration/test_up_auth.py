"""``kairos up`` with credentials: an API key on /v1/* and one NATS user per service role (anonymous
bus clients refused, no permission violation), and on an operator's nats-server configured with
``kairos nats-auth``."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.integration.conftest import free_port
from tests.integration.up_helpers import post, spawn, start_up  # noqa: F401 (spawn: fixture)

pytestmark = pytest.mark.integration


def _call(port: int, path: str, body: dict | None = None, key: str | None = None) -> tuple[int, dict, dict]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode() if body else None,
                                 headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            raw = r.read()
            return r.status, dict(r.headers), json.loads(raw) if path != "/metrics" else {}
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def test_kairos_up_with_api_key_and_nats_credentials(tmp_path, spawn):
    """The whole stack serves with per-role NATS credentials (no permission violation logged by
    the server), refuses anonymous bus clients, and requires the API key on /v1/*."""
    import asyncio

    import nats
    import nats.errors

    port = free_port()
    logs = tmp_path / "logs"
    proc, table = start_up(spawn, port, "--prefill", "1", "--decode", "1", "--dispatchers", "1", "--api-key",
                           "sk-test-1", "--log-dir", str(logs))
    assert "API key required" in table and "one generated user per service role" in table, table
    body = {"model": "kairos-emulated", "prompt": "Hello there", "max_tokens": 3}
    status, headers, out = _call(port, "/v1/completions", body)
    assert status == 401 and out["error"]["code"] == "invalid_api_key", out
    assert out["error"]["type"] == "invalid_request_error" and headers.get("WWW-Authenticate") == "Bearer"
    status, _, out = _call(port, "/v1/completions", body, key="sk-wrong")
    assert status == 401 and "sk-wrong" not in json.dumps(out), out
    assert _call(port, "/v1/models")[0] == 401
    assert _call(port, "/health")[0] == 200  # probes stay open
    assert _call(port, "/metrics")[0] == 200
    status, _, out = _call(port, "/v1/completions", body, key="sk-test-1")
    assert status == 200 and out["usage"]["completion_tokens"] == 3, out
    chat = {"model": "kairos-emulated", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "stream": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(chat).encode(),
                                 {"Content-Type": "application/json", "Authorization": "Bearer sk-test-1"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200 and r.read().rstrip().endswith(b"data: [DONE]")
    # the request record is read back from the KV bucket under the ingress's credential
    deadline = time.monotonic() + 10
    while ((rec := _call(port, f"/v1/requests/{out['id']}", key="sk-test-1"))[0] != 200
           or not all(rec[2]["records"][p] for p in ("ingress", "prefill", "decode"))):
        assert time.monotonic() < deadline, rec
        time.sleep(0.1)
    nats_url = next(w for w in table.split() if w.startswith("nats://"))

    async def anonymous() -> None:
        await nats.connect(nats_url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)

    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        asyncio.run(anonymous())
    # the table says how to profile a node of this stack: the profiler's password file logs in
    line = next(ln for ln in table.splitlines() if ln.startswith("Profile"))
    pw_file = next(w.split("=", 1)[1] for w in line.split() if w.startswith("KAIROS_NATS_PASSWORD_FILE="))
    assert "KAIROS_NATS_USER=profiler" in line and f"--nats-url {nats_url}" in line, line

    async def as_profiler() -> None:
        nc = await nats.connect(nats_url, user="profiler", password=Path(pw_file).read_text().strip(),
                                allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
        await nc.close()

    asyncio.run(as_profiler())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    server_log = (logs / "nats-server.log").read_text()
    assert "authentication error" in server_log  # our anonymous attempt was logged ...
    assert "Violation" not in server_log, \
        [ln for ln in server_log.splitlines() if "Violation" in ln][:5]  # ... and no service hit a permission


def test_kairos_up_on_an_external_nats_with_the_deployment_auth_config(tmp_path, spawn):
    """An operator's nats-server configured with `kairos nats-auth` (passwords from its
    environment) and `kairos up --nats-url … --nats-secrets-dir …` on it: requests are served."""
    secrets = tmp_path / "secrets"
    r = subprocess.run([sys.executable, "-m", "kairos", "nats-auth", "--nodes", "prefill-0,decode-0",
                        "--secrets-dir", str(secrets)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    conf = subprocess.run([sys.executable, "-m", "kairos", "nats-auth", "--nodes", "prefill-0,decode-0"],
                          capture_output=True, text=True, timeout=60).stdout
    (tmp_path / "nats.conf").write_text(conf)
    server_env = dict(ln.split("=", 1) for ln in (secrets / "nats-server.env").read_text().splitlines())
    nport = free_port()
    spawn([str(Path(sys.executable).parent / "nats-server"), "-c", str(tmp_path / "nats.conf"), "-js", "-a",
           "127.0.0.1", "-p", str(nport), "-sd", str(tmp_path / "js")], env=server_env,
          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", nport), timeout=0.2).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "nats-server did not start"
            time.sleep(0.05)
    port = free_port()
    proc, _ = start_up(spawn, port, "--prefill", "1", "--decode", "1", "--dispatchers", "1", "--nats-url",
                       f"nats://127.0.0.1:{nport}", "--nats-secrets-dir", str(secrets))
    status, out = post(port, {"model": "kairos-emulated", "prompt": "Hello there", "max_tokens": 3})
    assert status == 200 and out["usage"]["completion_tokens"] == 3, out
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert (secrets / "ingress.password").is_file()  # an operator's secrets are never removed
