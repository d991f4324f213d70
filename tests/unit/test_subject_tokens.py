"""A subject token (kairos/contracts/subjects.py ``check_token``: node ids, request ids, replica ids) is
``[A-Za-z0-9_-]{1,128}`` and nothing more: a trailing newline — a value read from a file or an env file,
or a ``%0A`` in a URL — is refused too (``$`` alone let one through). Through ``GET /v1/requests/{id}`` it
was a 500 ``internal_error`` (nats-py's KV refused the key, with a traceback in the log)."""

from __future__ import annotations

import pytest
from yarl import URL

from kairos.contracts.subjects import SubjectError, check_token
from kairos.runtime.envconfig import ConfigError, from_env
from kairos.services.dispatcher.config import DispatcherConfig
from kairos.services.node_agent.config import AgentConfig
from tests.unit.test_ingress_relay import stack  # noqa: F401 (fixture)


@pytest.mark.parametrize("token", ["decode-0\n", "\n", "decode-0\r\n", "decode-0\x00"])
def test_a_token_with_a_trailing_line_break_is_refused(token):
    with pytest.raises(SubjectError, match=r"must match \[A-Za-z0-9_-\]"):
        check_token(token, "node id")
    assert check_token("decode-0") == "decode-0"


def test_ids_from_the_environment_with_a_trailing_newline_exit_as_bad_config():
    with pytest.raises(ConfigError, match="^KAIROS_REPLICA_ID: "):
        from_env(DispatcherConfig, {"KAIROS_REPLICA_ID": "dispatcher-0\n"})
    with pytest.raises(ConfigError, match="^KAIROS_NODE_ID: "):
        from_env(AgentConfig, {"KAIROS_NODE_ID": "decode-0\n", "KAIROS_ROLE": "decode"})


async def test_a_request_id_with_an_encoded_newline_is_400_invalid_request_id(stack):
    async with stack.http.get(URL(f"{stack.base}/v1/requests/cmpl-abc%0A", encoded=True)) as r:
        status, err = r.status, (await r.json())["error"]
    assert status == 400 and err["code"] == "invalid_request_id", (status, err)
