"""The ingress's request body cap (``KAIROS_MAX_BODY_BYTES``, kairos/services/ingress/config.py): 16 MiB
by default (it was 64 MiB: a 30 MB prompt was parsed and tokenized for 27 s), validated, and a body over
it is a 413 ``request_too_large`` naming the limit, on the completion endpoints and ``/tokenize``."""

from __future__ import annotations

import aiohttp
import pytest

from kairos.runtime.envconfig import ConfigError, from_env
from kairos.services.ingress.config import IngressConfig
from tests.unit.test_ingress_parity_endpoints import MODEL, serve

DEFAULT_LIMIT = 16 * 1024 * 1024


def test_the_default_limit_and_its_validation():
    assert IngressConfig().max_body_bytes == DEFAULT_LIMIT
    assert from_env(IngressConfig, {"KAIROS_MAX_BODY_BYTES": "2048"}).max_body_bytes == 2048
    with pytest.raises(ConfigError, match="KAIROS_MAX_BODY_BYTES: must be >= 1024"):
        from_env(IngressConfig, {"KAIROS_MAX_BODY_BYTES": "100"})
    with pytest.raises(ConfigError, match="KAIROS_MAX_BODY_BYTES"):
        from_env(IngressConfig, {"KAIROS_MAX_BODY_BYTES": "lots"})


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
async def test_a_body_over_the_default_limit_is_413_naming_it(path):
    ing, base = await serve()
    try:
        body = b'{"model": "%s", "prompt": "%s"}' % (MODEL.encode(), b"x" * DEFAULT_LIMIT)
        async with aiohttp.ClientSession() as http, \
                http.post(base + path, data=body, headers={"Content-Type": "application/json"}) as r:
            status, out = r.status, await r.json()
        assert status == 413, out
        assert out["error"]["code"] == "request_too_large" and out["error"]["type"] == "invalid_request_error"
        assert f"the limit is {DEFAULT_LIMIT} bytes" in out["error"]["message"], out
    finally:
        await ing.close()
