"""LoRA adapters through the router, over fake replicas: a load goes to every replica of the
model and the adapter is listed with its parent; the adapter's requests keep its name and all
land on one replica (affinity by adapter, whatever the prompt); an unload forgets it; adapters
from the engines' --lora-modules are known from the start."""
import asyncio
import json

import httpx

from pagedserve.pipeline.router.app import build_router_app
from pagedserve.pipeline.router.config import GroupSpec
from pagedserve.pipeline.router.lora import RouterAdapters
from test_router_resume import make_service

AUTH = {"Authorization": "Bearer k"}


def test_load_route_by_adapter_and_unload():
    seen = []

    def handler(request):
        body = json.loads(request.content)
        seen.append((request.url.host, request.url.path, body))
        if request.url.path.endswith("_lora_adapter"):
            return httpx.Response(200, json={"lora_name": body["lora_name"], "status": "ok"})
        return httpx.Response(200, json={"choices": [{"index": 0, "text": "x",
                                                      "finish_reason": "length"}],
                                          "usage": {"total_tokens": 3}})

    async def run():
        service, _, _ = make_service(handler)
        app = build_router_app(service, ["k"])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://router") as client:
            load = {"lora_name": "sql", "lora_path": "/adapters/sql"}
            assert (await client.post("/v1/load_lora_adapter", json=load)).status_code == 401
            assert (await client.post("/v1/load_lora_adapter", json=load,
                                      headers=AUTH)).status_code == 200
            models = (await client.get("/v1/models", headers=AUTH)).json()["data"]
            for i in range(6):
                answer = await client.post("/v1/completions", headers=AUTH, json={
                    "model": "sql", "prompt": f"different prompt {i}", "max_tokens": 1})
                assert answer.status_code == 200
            unloaded = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"},
                                         headers=AUTH)
            gone = await client.post("/v1/completions", headers=AUTH, json={
                "model": "sql", "prompt": "x", "max_tokens": 1})
            return models, unloaded.status_code, gone.status_code

    models, unloaded, gone = asyncio.run(run())
    assert [(m["id"], m.get("parent")) for m in models] == [("m", None), ("sql", "m")]
    loads = [(host, body) for host, path, body in seen if path == "/v1/load_lora_adapter"]
    assert sorted(host for host, _ in loads) == ["m-0", "m-1"]   # every replica of m
    hosts = {host for host, path, body in seen if path == "/v1/completions"}
    names = {body["model"] for _, path, body in seen if path == "/v1/completions"}
    assert len(hosts) == 1 and names == {"sql"}
    assert unloaded == 200 and gone == 404
    assert sum(path == "/v1/unload_lora_adapter" for _, path, _ in seen) == 2


def test_adapters_of_the_engines_lora_modules_are_known_from_the_start():
    specs = [GroupSpec("m", "/models/m", ("--enable-lora", "--lora-modules", "a=/x", "b=/y",
                                          "--max-loras", "2")),
             GroupSpec("n", "/models/n", ("--dtype", "float32"))]
    adapters = RouterAdapters.from_specs(specs)
    assert adapters.base_of == {"a": "m", "b": "m"}
    assert adapters.base("a") == "m" and adapters.base("n") is None and adapters.base(3) is None


def test_a_restarted_replica_gets_the_adapters_loaded_through_the_router_before_requests():
    seen = []

    class RestartedGroup:   # what ReplicaPool._until_ready reads of a LocalGroup
        name, url, headers, started_at = "m/1", "http://m-1", {}, 0.0
        spec = GroupSpec("m", "/models/m")

        async def wait_ready(self, http, timeout):
            return {"id": "m", "max_model_len": 100}

    def handler(request):
        seen.append((request.url.host, json.loads(request.content),
                     service.core.replicas["m/1"].healthy))
        return httpx.Response(200, json={"status": "ok"})

    async def run():
        service.adapters.add("sql", "m", {"lora_name": "sql", "lora_path": "/adapters/sql"})
        service.adapters.base_of["other"] = "n"     # another model's: not replayed here
        service.pool.on_ready.append(lambda r: service.adapters.replay(service.http, r))
        service.core.set_healthy("m/1", False)       # died; the pool restarted it
        await service.pool._until_ready(RestartedGroup())

    service, _, _ = make_service(handler)
    asyncio.run(run())
    assert seen == [("m-1", {"lora_name": "sql", "lora_path": "/adapters/sql"}, False)]
    assert service.core.replicas["m/1"].healthy
