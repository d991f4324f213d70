"""``GET /openapi.json``: the OpenAPI 3.1 document generated from the request and response models (issue 36).

The document is checked by a validator (openapi-spec-validator: the OpenAPI 3.1 meta-schema and its
JSON Schema 2020-12 dialect), its routes are the application's, its request parameters are
:data:`PARAMETERS` (the README table's: each table example fits its field's schema, each refused
value does not), and the bodies the ingress builds fit their response schemas.
"""

from __future__ import annotations

import aiohttp
import jsonschema
import pytest
from openapi_spec_validator import validate

from kairos.contracts.errors import ErrorCode
from kairos.contracts.events import TokenLogprob
from kairos.services.ingress.openai_api import models as M
from kairos.services.ingress.openai_api.openapi import ROUTES, openapi_document
from kairos.services.ingress.openai_api.params import PARAMETERS, ParsedRequest, parameters
from kairos.services.ingress.openai_api.responses import (ApiError, full_response, models_response, stream_chunk,
                                                          usage_chunk)
from tests.unit.openai_cases import BAD
from tests.unit.test_ingress_parity_endpoints import serve

DOC = openapi_document("test")


def schema_of(name: str) -> dict:
    """A validator's schema for the component ``name`` (its ``$ref``s resolved in the document)."""
    return {"$ref": f"#/components/schemas/{name}", "components": DOC["components"]}


def fits(value, name: str, prop: str | None = None) -> bool:
    schema = schema_of(name) if prop is None else {
        **DOC["components"]["schemas"][name]["properties"][prop], "components": DOC["components"]}
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def test_the_document_is_valid_openapi_3_1():
    validate(DOC)  # raises OpenAPIValidationError on a document the 3.1 meta-schema refuses
    assert DOC["openapi"] == "3.1.0" and DOC["info"]["version"] == "test"


def test_model_is_the_served_model():  # any other is a 404: the fuzzer's requests reach the validation
    doc = openapi_document("test", "served-x")
    for name in ("CompletionRequest", "ChatCompletionRequest", "TokenizeCompletionRequest", "DetokenizeRequest"):
        model = doc["components"]["schemas"][name]["properties"]["model"]
        assert model["enum"][0] == "served-x" and fits("served-x", name, "model") is False  # DOC serves another


def test_every_parameter_of_the_table_is_a_field_of_its_request_model_with_its_description():
    for endpoint, model in (("completions", M.CompletionRequest), ("chat", M.ChatCompletionRequest)):
        props = DOC["components"]["schemas"][model.__name__]["properties"]
        assert set(props) == set(parameters(endpoint)), endpoint  # neither more nor fewer
        for name, p in parameters(endpoint).items():
            assert props[name]["description"] == f"{p.support}: {p.how}"
            assert props[name].get("examples") == (None if p.example is None else [p.example])


@pytest.mark.parametrize("p", PARAMETERS, ids=lambda p: p.name)
def test_table_examples_fit_the_schema_and_refused_values_do_not(p):
    for endpoint in (("completions", "chat") if p.endpoints == "both" else (p.endpoints,)):
        model = {"completions": "CompletionRequest", "chat": "ChatCompletionRequest"}[endpoint]
        if p.example is not None:
            assert fits(p.example, model, p.name), (endpoint, p.example)
        if p.support == "refused":
            assert not fits(BAD[p.name], model, p.name), (endpoint, BAD[p.name])
            assert all(fits(a, model, p.name) for a in p.allowed)


async def test_the_ingress_serves_the_document_without_a_key_and_every_route_is_in_it():
    ing, base = await serve(api_keys=("k1",))
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(base + "/openapi.json") as r:  # no key: public, as vLLM's
                assert r.status == 200 and r.content_type == "application/json"
                doc = await r.json()
        routes = {(res.method.lower(), res.resource.canonical) for res in ing.app.router.routes()
                  if res.method != "HEAD"}
        vocab = ing.completions.vocab_size
    finally:
        await ing.close()
    ids = doc["components"]["schemas"]["CompletionRequest"]["properties"]["stop_token_ids"]["anyOf"][0]["items"]
    assert ids["maximum"] == vocab - 1  # the served vocabulary
    documented = {(m, p.replace("{id}", "{rid}")) for p, ops in doc["paths"].items() for m in ops}
    assert documented == routes
    assert {(r.method, r.path) for r in ROUTES} == {(m, p) for p, ops in doc["paths"].items() for m in ops}
    assert {p for p, ops in doc["paths"].items() for op in ops.values() if op.get("security") == []} == \
        {"/health", "/metrics", "/version", "/openapi.json"}


def test_token_ids_are_below_the_served_vocabulary():
    """``prompt`` and ``stop_token_ids`` ids below the served vocabulary, as the server checks them (a
    document without a vocabulary, and the models' own schemas, keep no bound)."""
    doc = openapi_document("test", "m", vocab_size=100)

    def ok(name: str, prop: str, value) -> bool:
        schema = {**doc["components"]["schemas"][name]["properties"][prop], "components": doc["components"]}
        return jsonschema.Draft202012Validator(schema).is_valid(value)

    for name in ("CompletionRequest", "ChatCompletionRequest"):
        assert ok(name, "stop_token_ids", [0, 99]) and not ok(name, "stop_token_ids", [100])
    assert ok("CompletionRequest", "prompt", [99]) and ok("CompletionRequest", "prompt", [[1], [99]])
    assert not ok("CompletionRequest", "prompt", [100]) and not ok("CompletionRequest", "prompt", [[1], [100]])
    assert fits([100], "CompletionRequest", "prompt") and fits([10**6], "CompletionRequest", "stop_token_ids")
    assert fits([100], "CompletionRequest", "prompt")  # DOC (no vocabulary) unchanged by the call above
    props = openapi_document("other", "m")["components"]["schemas"]["CompletionRequest"]["properties"]
    assert "maximum" not in str(props["prompt"]) + str(props["stop_token_ids"])  # the models' schemas untouched


def test_an_open_ingress_declares_no_security_and_one_with_keys_a_bearer_key():
    keyed, open_ = openapi_document("v", "m", api_keys=True), openapi_document("v", "m", api_keys=False)
    assert keyed["security"] == [{"apiKey": []}] and keyed["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"
    assert "security" not in open_ and "securitySchemes" not in open_["components"]
    validate(open_)


def _req(endpoint: str, logprobs: int | None = None) -> ParsedRequest:
    from kairos.contracts.wire import SamplingParams

    return ParsedRequest(endpoint=endpoint, model="m", prompt_text="hi", prompt_token_ids=None, max_tokens=2,
                         stream=False, include_usage=True, sampling=SamplingParams(logprobs=logprobs))


@pytest.mark.parametrize("endpoint,logprobs", [("completions", None), ("completions", 2), ("chat", None),
                                                ("chat", 1)])
def test_the_bodies_the_ingress_builds_fit_their_response_schemas(endpoint, logprobs):
    req = _req(endpoint, logprobs)
    lps = [TokenLogprob(token="a", logprob=-0.5, top=[("a", -0.5), ("b", -1.5)])]
    body = full_response(req, "cmpl-1", 1, "ab", "stop", 3, 2, 1, logprobs=lps, stop_reason=7)
    assert fits(body, "CompletionResponse" if endpoint == "completions" else "ChatCompletionResponse")
    chunk_model = "CompletionChunk" if endpoint == "completions" else "ChatCompletionChunk"
    for chunk in (stream_chunk(req, "cmpl-1", 1, "a", None, first=True, echo=True),
                  stream_chunk(req, "cmpl-1", 1, None, "stop", logprobs=body["choices"][0]["logprobs"],
                               stop_reason="x"),
                  usage_chunk(req, "cmpl-1", 1, 3, 2)):
        assert fits(chunk, chunk_model), chunk  # the SSE events' data (fuzzing found them undeclared)
    assert fits(models_response(["m"], 4096), "ModelList") and fits(models_response(["m"]), "ModelList")
    for code in ErrorCode:
        assert fits(ApiError(code, "no", param="x").body(), "ErrorResponse"), code
    assert not fits({"error": {"message": "m", "type": "t", "param": None, "code": "not_a_code"}}, "ErrorResponse")
