"""The dispatcher's ``KAIROS_REPLICA_ID`` (kairos/services/dispatcher/config.py) is checked as node ids are
(kairos/contracts/subjects.py ``check_token``): it names the replica's NATS client and the source of its
decision records and error events, so a bad one is a config error naming the variable (the main exits 2)."""

from __future__ import annotations

import pytest

from kairos.runtime.envconfig import ConfigError, from_env
from kairos.services.dispatcher.config import DispatcherConfig


@pytest.mark.parametrize("rid", ["dispatcher.0", "", "a b", "kairos.>", "d" * 129])
def test_a_replica_id_that_is_not_a_subject_token_is_refused_naming_the_variable(rid):
    with pytest.raises(ConfigError, match=r"^KAIROS_REPLICA_ID: replica id .* must match \[A-Za-z0-9_-\]\{1,128\}"):
        from_env(DispatcherConfig, {"KAIROS_REPLICA_ID": rid})


def test_the_default_and_kairos_ups_replica_ids_are_valid():
    assert DispatcherConfig().replica_id.startswith("dispatcher-")  # dispatcher-<pid>
    assert from_env(DispatcherConfig, {"KAIROS_REPLICA_ID": "dispatcher-3"}).replica_id == "dispatcher-3"
    assert from_env(DispatcherConfig, {"KAIROS_REPLICA_ID": "d" * 128}).replica_id == "d" * 128
