"""Which policies the live stack runs: the simulator-only baseline (taichi) is refused by `kairos
up`/`demo` and by a dispatcher's configuration, and not offered among their known policies."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from kairos.cli.main import main


@pytest.mark.parametrize("command", [["up"], ["demo"]])
def test_live_commands_refuse_the_simulator_only_policy_and_do_not_offer_it(command):
    res = CliRunner().invoke(main, [*command, "--policy", "taichi"])
    assert res.exit_code == 2 and "kairos sim --policy taichi" in res.output
    res = CliRunner().invoke(main, [*command, "--policy", "bogus"])
    assert res.exit_code == 2 and "unknown policy 'bogus'" in res.output
    known = res.output.split("known:", 1)[1]
    assert "kairos+" in known and "taichi" not in known


def test_a_dispatcher_configured_with_a_simulator_only_policy_refuses_to_start():
    from kairos.services.dispatcher.config import DispatcherConfig
    from kairos.runtime.envconfig import ConfigError

    with pytest.raises(ConfigError, match="simulator baseline"):
        DispatcherConfig(policy="taichi")
    assert DispatcherConfig(policy="kairos+").policy == "kairos+"
