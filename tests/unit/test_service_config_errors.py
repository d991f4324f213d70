"""A service started with a bad KAIROS_* value exits 2 with one line naming it, never a traceback
(docs/services.md; found by a new user's trial: an unknown profile, a malformed NATS URL, ``inf`` for
a duration, an unknown log level and a missing tokenizer each ended in a traceback, exit 1, or a
connect loop that never ends)."""

import os
import subprocess
import sys

import pytest

#: nothing listens there: a service that got past its configuration would retry forever (the timeout)
UNREACHABLE = "nats://127.0.0.1:1"


def start(module: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KAIROS_")}
    return subprocess.run([sys.executable, "-m", f"kairos.services.{module}"], capture_output=True, text=True,
                          timeout=60, env={**base, "KAIROS_NATS_URL": UNREACHABLE, "KAIROS_METRICS_PORT": "-1",
                                           **env})


@pytest.mark.parametrize("module, env, says", [
    ("dispatcher", {"KAIROS_PROFILE": "nope"}, "no profile 'nope'"),
    ("node_agent", {"KAIROS_PROFILE": "nope", "KAIROS_NODE_ID": "decode-0", "KAIROS_ROLE": "decode"},
     "no profile 'nope'"),
    ("ingress", {"KAIROS_TOKENIZER_PATH": "/nonexistent/tokenizer.json"}, "KAIROS_TOKENIZER_PATH"),
    ("dispatcher", {"KAIROS_NATS_URL": "bogus"}, "KAIROS_NATS_URL"),
    ("state_aggregator", {"KAIROS_NATS_URL": "http://x:4222"}, "KAIROS_NATS_URL"),
    ("ingress", {"KAIROS_ROUTE_STALL_S": "inf"}, "KAIROS_ROUTE_STALL_S"),
    ("ingress", {"KAIROS_LOG_LEVEL": "loud"}, "KAIROS_LOG_LEVEL"),
])
def test_a_bad_value_exits_2_naming_it_without_a_traceback(module, env, says):
    proc = start(module, **env)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("url", ["nats://a:4222,tls://b:4222", "ws://h:8080", "nats://[::1]:4222"])
def test_every_nats_url_form_nats_py_connects_with_is_accepted(url):
    from kairos.runtime.envconfig import ServiceConfig, from_env

    assert from_env(ServiceConfig, env={"KAIROS_NATS_URL": url}).nats_url == url
