"""/openapi.json documents every route, the request bodies as protocol.py parses them, the
served model's limits and the error responses; schemathesis over it finds nothing (FakeEngine)."""
import asyncio
import json

import httpx
import pytest

from script_module import load_script

from pagedserve.pipeline.ingress import build_app
from pagedserve.pipeline.ingress.protocol import (LIMIT_KEY, ChatCompletionRequest,
                                                  CompletionRequest)
from pagedserve.pipeline.ingress.testing import make_test_context

ROUTES = {"/v1/completions": "post", "/v1/chat/completions": "post", "/v1/models": "get",
          "/v1/messages": "post", "/v1/responses": "post", "/v1/embeddings": "post",
          "/v1/load_lora_adapter": "post", "/v1/unload_lora_adapter": "post",
          "/tokenize": "post", "/detokenize": "post", "/infill": "post",
          "/health": "get", "/version": "get", "/metrics": "get"}
# Behind the API key: /v1, and vLLM's and llama.cpp's routes outside it.
KEYED = {path for path in ROUTES if path.startswith("/v1/")} | {"/tokenize", "/detokenize",
                                                                "/infill"}


def served_schema(**ctx_kwargs) -> dict:
    async def get():
        ctx, _ = make_test_context(**ctx_kwargs)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(ctx)),
                                     base_url="http://test") as client:
            r = await client.get("/openapi.json")
            assert r.status_code == 200
            return r.json()
    return asyncio.run(get())


def test_every_route_is_documented_with_its_body_and_errors():
    schema = served_schema()
    assert schema["openapi"].startswith("3.1")
    documented = {path: set(ops) for path, ops in schema["paths"].items()}
    assert documented == {path: {method} for path, method in ROUTES.items()}
    components = schema["components"]["schemas"]
    for path, model in (("/v1/completions", CompletionRequest),
                        ("/v1/chat/completions", ChatCompletionRequest)):
        op = schema["paths"][path]["post"]
        body = op["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model.__name__}"}
        assert set(components[model.__name__]["properties"]) == set(model.model_fields)
        assert set(op["responses"]) == {"200", "400", "404", "408", "413", "414", "431", "503"}
        assert set(op["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
        for status in ("400", "404", "408", "413", "414", "431", "503"):
            assert op["responses"][status]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/ErrorResponse"}
        assert "Retry-After" in op["responses"]["503"]["headers"]
        assert "security" not in op
    assert set(schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "content" not in schema["paths"]["/health"]["get"]["responses"]["200"]


def test_completions_document_echo_logprobs_and_prompt_logprobs():
    components = served_schema()["components"]["schemas"]
    fields = components["CompletionRequest"]["properties"]
    assert {"type": "integer", "minimum": 0, "maximum": 20} in fields["prompt_logprobs"]["anyOf"]
    choice = components["CompletionChoice"]["properties"]
    assert "prompt_logprobs" in choice
    assert {"type": "null"} in components["CompletionLogprobs"]["properties"][
        "top_logprobs"]["items"]["anyOf"]


def test_token_and_infill_routes_document_their_bodies_and_answers():
    from pagedserve.pipeline.ingress.infill import InfillRequest
    from pagedserve.pipeline.ingress.tokenize import (DetokenizeRequest, TokenizeChatRequest,
                                                      TokenizeCompletionRequest)
    schema = served_schema()
    components = schema["components"]["schemas"]

    def body(path):
        op = schema["paths"][path]["post"]
        return op, op["requestBody"]["content"]["application/json"]["schema"]
    op, tokenize = body("/tokenize")
    assert tokenize == {"anyOf": [{"$ref": "#/components/schemas/TokenizeCompletionRequest"},
                                  {"$ref": "#/components/schemas/TokenizeChatRequest"}]}
    assert set(op["responses"]) == {"200", "400", "404", "408", "413", "414", "431"}
    assert op["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/TokenizeResponse"}
    for model in (TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest,
                  InfillRequest):
        assert set(components[model.__name__]["properties"]) == set(model.model_fields)
    assert body("/detokenize")[1] == {"$ref": "#/components/schemas/DetokenizeRequest"}
    tokens = components["DetokenizeRequest"]["properties"]["tokens"]
    assert tokens["items"] == {"type": "integer", "minimum": 0, "maximum": 258}
    op, infill = body("/infill")
    assert infill == {"$ref": "#/components/schemas/InfillRequest"}
    assert set(op["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert set(components["InfillResponse"]["required"]) >= {"content", "stop", "tokens"}


def test_embeddings_route_documents_its_body_answer_and_dimensions_limit():
    from pagedserve.pipeline.ingress.embeddings import EmbeddingRequest
    schema = served_schema()
    op = schema["paths"]["/v1/embeddings"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/EmbeddingRequest"}
    assert op["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/EmbeddingResponse"}
    props = schema["components"]["schemas"]["EmbeddingRequest"]["properties"]
    assert set(props) == set(EmbeddingRequest.model_fields)
    dims = next(b for b in props["dimensions"]["anyOf"] if b.get("type") == "integer")
    assert dims == {"type": "integer", "minimum": 1, "maximum": 8}  # the fake's hidden size


def test_ranges_and_the_served_models_limits_are_documented():
    schema = served_schema(max_model_len=64, max_queued_requests=8, max_num_seqs=4)
    assert LIMIT_KEY not in json.dumps(schema)
    props = schema["components"]["schemas"]["CompletionRequest"]["properties"]

    def branch(name, type_):
        return next(b for b in props[name]["anyOf"] if b.get("type") == type_)
    assert branch("n", "integer")["maximum"] == 128  # IngressContext.max_n
    # 0: with echo, the prompt alone (chat's max_tokens starts at 1)
    assert branch("max_tokens", "integer") == {"type": "integer", "minimum": 0, "maximum": 63}
    assert branch("temperature", "number") == {"type": "number", "minimum": 0, "maximum": 2}
    token_lists = [b for b in props["prompt"]["anyOf"] if b["type"] == "array"]
    assert token_lists[1]["items"]["maximum"] == 258  # the tiny tokenizer's last id
    assert token_lists[0]["maxItems"] == 8  # a batch of prompts: at most what the queue holds
    bias = branch("logit_bias", "object")
    assert bias["additionalProperties"] == {"type": "number", "minimum": -100, "maximum": 100}


def test_bearer_security_on_v1_only_when_the_server_has_a_key():
    schema = served_schema(api_key="sekrit")
    assert schema["components"]["securitySchemes"] == {"bearer": {"type": "http",
                                                                  "scheme": "bearer"}}
    for path, method in ROUTES.items():
        op = schema["paths"][path][method]
        assert ("security" in op) == (path in KEYED)
        assert ("401" in op["responses"]) == (path in KEYED)


def _fuzz_api():
    return load_script("fuzz_api")


def test_schemathesis_over_every_operation_finds_nothing():
    """The fuzz's schema part against the app over a FakeEngine: no 5xx, every response as
    documented, every invalid body refused, the API key enforced."""
    pytest.importorskip("schemathesis")
    ctx, engine = make_test_context(api_key="sekrit")
    out = _fuzz_api().fuzz_schema(None, seed=1, max_examples=5, api_key="sekrit",
                                  app=build_app(ctx))
    assert out["failures"] == []
    assert out["phases"]["coverage"] == out["phases"]["fuzzing"] == "success"
    assert not [s for s in out["statuses"] if s.startswith("5")], out["statuses"]
    assert {"200", "400"} <= set(out["statuses"])
    assert all(s.params.max_tokens <= 4 for s in engine.submitted  # the fuzz bounds generation
               if s.pooling is None)                                 # (embeddings generate none)
    assert any(s.pooling is not None for s in engine.submitted)     # /v1/embeddings was reached
    assert ctx.admission.in_flight == 0
