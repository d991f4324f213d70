"""Node churn with real processes (issue 33): ``kairos up`` 2P2D, 2 dispatchers, under an open-loop
streaming load; one fault per case on a node agent, by pid — SIGTERM (a graceful drain), SIGKILL,
SIGSTOP for 5 s, a rolling restart of all four agents. ``kairos up`` restarts an agent that exits.

The harness is the churn benchmark's (``bench/churn.py``, shorter here); the truth each response is
compared with is the emulated engine's own output for its prompt, token for token. Targets: 0
failed, 0 cut, 0 wrong text, 0 duplicated tokens in every case; a migrated stream's largest
inter-token gap within the liveness timeout + 1 s after a SIGKILL; no out event of a paused node taken
for a forgery.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from kairos.services.ingress.config import IngressConfig
from tests.faults.conftest import REPO

pytestmark = [pytest.mark.faults, pytest.mark.timeout(600)]

_spec = importlib.util.spec_from_file_location("bench_churn", REPO / "bench" / "churn.py")
churn = importlib.util.module_from_spec(_spec)
sys.modules["bench_churn"] = churn  # its dataclasses look their module up there
_spec.loader.exec_module(churn)

RATE, DURATION_S, FAULT_AT_S = 8.0, 14.0, 5.0
LIVENESS_MS = IngressConfig().liveness_timeout_s * 1000.0


@pytest.mark.parametrize("case", churn.CASES)
async def test_a_node_fault_fails_cuts_and_garbles_nothing(case):
    row = await churn.run_case(case, RATE, DURATION_S, FAULT_AT_S, seed=7)
    print("churn:", json.dumps(row))
    assert row["sent"] >= row["rate_rps"] * DURATION_S * 0.7, row  # the prefill cases run at half the rate
    assert row["failed"] == row["cut"] == row["wrong_text"] == row["duplicated_tokens"] == 0, row
    assert row["forged"] == 0, row
    if case in ("decode-sigkill", "decode-sigstop"):  # streams were on the node: they moved
        assert row["migrated"] >= 1, row
    if case == "decode-sigkill":
        assert row["max_gap_migrated_ms"] <= LIVENESS_MS + 1000.0, row
