"""The ingress's error bodies against vLLM 0.32's own ``ErrorInfo`` model, read from the vLLM
virtualenv (``$KAIROS_VLLM_PYTHON``, which ``make test-vllm`` builds and sets).

This belongs to the vLLM tier: the unit tier needs nothing outside ``.venv`` (issue 32: it ran in
the unit tier and failed on every machine that had never built the vLLM virtualenv).
"""

from __future__ import annotations

import json
import os
import subprocess

import aiohttp
import pytest

from tests.unit.test_ingress_parity_endpoints import MODEL, call, serve

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300),
              pytest.mark.skipif(not os.environ.get("KAIROS_VLLM_PYTHON"),
                                 reason="no vLLM virtualenv ($KAIROS_VLLM_PYTHON; make test-vllm sets it)")]


def vllm_error_info_fields() -> list[str]:
    """The fields of ``vllm.entrypoints.serve.engine.protocol.ErrorInfo`` (a pydantic model), in
    declaration order, as the vLLM python imports it."""
    code = ("import json; from vllm.entrypoints.serve.engine.protocol import ErrorInfo; "
            "print(json.dumps(list(ErrorInfo.model_fields)))")
    out = subprocess.run([os.environ["KAIROS_VLLM_PYTHON"], "-c", code], capture_output=True, text=True,
                         timeout=240, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


async def test_error_bodies_have_the_fields_of_vllms_error_info_with_openais_values():
    """vLLM's ``ErrorResponse`` is ``{"error": {message, type, param, code}}`` as OpenAI's; its values
    differ (``type`` the SDK's exception name, ``code`` the HTTP status): Kairos keeps OpenAI's
    (``code`` a string of its catalogue, ``type`` OpenAI's), which the ``openai`` SDK reads, and the
    status is the HTTP status. The fields are the same, none missing, none added."""
    fields = vllm_error_info_fields()
    assert fields == ["message", "type", "param", "code"]
    ing, base = await serve()
    try:
        async with aiohttp.ClientSession() as http:
            for method, path, body in (("POST", "/v1/completions", {"model": "nope", "prompt": "a"}),
                                       ("POST", "/tokenize", {"model": "nope", "prompt": "a"}),
                                       ("GET", "/no/such/path", None), ("POST", "/v1/completions", {"model": MODEL})):
                st, _, err = await call(http, base + path, body, method=method)
                assert st >= 400 and list(err) == ["error"] and list(err["error"]) == fields, err
                assert isinstance(err["error"]["message"], str) and isinstance(err["error"]["code"], str)
    finally:
        await ing.close()
