"""Service mains (``python -m kairos.services.<name>``) exit 2 naming a bad or missing config field."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("module,env,field", [
    ("kairos.services.dispatcher", {"KAIROS_POLICY": "bogus"}, "KAIROS_POLICY"),
    ("kairos.services.dispatcher", {"KAIROS_ALPHA": "0.5"}, "KAIROS_ALPHA"),
    # it becomes a token of the replica's NATS client name and of its records' and errors' source
    ("kairos.services.dispatcher", {"KAIROS_REPLICA_ID": "dispatcher.0"}, "KAIROS_REPLICA_ID"),
    ("kairos.services.dispatcher", {"KAIROS_REPLICA_ID": ""}, "KAIROS_REPLICA_ID"),
    ("kairos.services.node_agent", {"KAIROS_NODE_ID": "decode-0", "KAIROS_ROLE": "middle"}, "KAIROS_ROLE"),
    ("kairos.services.node_agent", {"KAIROS_ROLE": "decode"}, "KAIROS_NODE_ID"),
    ("kairos.services.ingress", {"KAIROS_PORT": "eighty"}, "KAIROS_PORT"),
    ("kairos.services.state_aggregator", {"KAIROS_STATE_PERIOD_MS": "-1"}, "KAIROS_STATE_PERIOD_MS"),
    ("kairos.services.dispatcher", {"KAIROS_NATS_USER": "dispatcher"}, "KAIROS_NATS_PASSWORD"),
    ("kairos.services.state_aggregator", {"KAIROS_NATS_PASSWORD": "x"}, "KAIROS_NATS_USER"),
    ("kairos.services.node_agent", {"KAIROS_NODE_ID": "decode-0", "KAIROS_ROLE": "decode", "KAIROS_NATS_USER": "agent-decode-0",
                             "KAIROS_NATS_PASSWORD_FILE": "/nonexistent/pw"}, "KAIROS_NATS_PASSWORD_FILE"),
    ("kairos.services.ingress", {"KAIROS_API_KEY_FILE": "/nonexistent/keys"}, "KAIROS_API_KEY_FILE"),
], ids=["policy", "alpha", "replica-id", "empty-replica-id", "role", "missing-node-id", "port", "period", "user-without-password",
        "password-without-user", "unreadable-password-file", "unreadable-api-key-file"])
def test_bad_config_exits_nonzero_naming_the_field(module, env, field):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KAIROS_")}
    r = subprocess.run([sys.executable, "-m", module], env={**clean, **env}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert field in r.stderr, r.stderr
