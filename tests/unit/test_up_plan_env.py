"""``kairos up``'s children's configuration (kairos/cli/up_plan.py ``plan``): what its flags set,
over the caller's ``KAIROS_*`` environment. Issue 33's trial: ``KAIROS_DRAIN_TIMEOUT_S=3 kairos up``
gave the agents the default 60 s, the documented knob had no effect through ``kairos up``."""

from __future__ import annotations

from pathlib import Path

import pytest

from kairos.cli.up_plan import UpOptions, plan
from kairos.runtime.envconfig import ConfigError, from_env
from kairos.services.dispatcher.config import DispatcherConfig
from kairos.services.node_agent.config import AgentConfig


def children(tmp_path: Path) -> dict:
    return {c.name: c.env for c in plan(UpOptions(prefill=1, decode=1, dispatchers=1), "nats://127.0.0.1:4222",
                                        tmp_path)}


def test_a_variable_without_a_flag_reaches_the_services_and_a_flag_wins_over_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KAIROS_DRAIN_TIMEOUT_S", "3")
    monkeypatch.setenv("KAIROS_POLICY", "pd")  # kairos up's --policy (its default) is what runs
    env = children(tmp_path)
    for node in ("prefill-0", "decode-0"):
        cfg = from_env(AgentConfig, env[node])
        assert cfg.drain_timeout_s == 3.0 and cfg.node_id == node
    assert from_env(DispatcherConfig, env["dispatcher-0"]).policy == UpOptions().policy != "pd"


def test_a_bad_variable_is_refused_before_anything_starts(monkeypatch, tmp_path):
    monkeypatch.setenv("KAIROS_DRAIN_TIMEOUT_S", "soon")
    with pytest.raises(ConfigError, match="KAIROS_DRAIN_TIMEOUT_S"):
        children(tmp_path)
