"""Fuzz a running server's HTTP API, then check that it is still whole.

Starts nothing: point it at a server (`scripts/launch.sh`, or tests.faults.conftest.Group with
http=True). Five parts, each bounded in count and time:

1. schema: schemathesis over every operation of the served /openapi.json (its coverage and
   fuzzing phases, positive and negative data, a seed, --max-examples per operation): no 5xx,
   status codes, content types, headers and bodies as documented, invalid data refused;
2. slow: --slow-clients connections sending a valid request one byte a second for
   --slow-seconds (then the rest at once), while a normal request must still be served;
3. drop: --connections connections, --concurrency at a time, each sending part of a request
   (headers only, half a body, or a whole streaming request read to its first chunk) and closing;
4. oversize: 64 KiB of headers, a 64 KiB request line, and bodies over --max-request-bytes
   (declared and chunked);
5. hostile: each request of scripts/hostile_requests.py once (a field far past its limit: stop
   strings, nesting, n, logit_bias, messages, tools, schema depth): a 4xx naming the field.

Then: the engine's KV pool back to 0 (GET /metrics: vllm:kv_cache_usage_perc and
vllm:num_requests_running both 0 within --settle-timeout) and a normal completion served. Prints
one JSON object last (requests per part, statuses, the 5xx count, failures) and stores it with
scripts/bench_record.py unless --no-store. Exits 1 when anything failed.

    python scripts/fuzz_api.py --base-url http://127.0.0.1:8000 --connections 10000
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

SCHEMA_CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
                 "response_headers_conformance", "response_schema_conformance",
                 "negative_data_rejection", "ignored_auth")
DROP_KINDS = ("headers_only", "half_body", "stream_first_chunk")
MAX_FUZZ_N = 2  # samples per generated request: n=128 x every case would take the run's time


# -- 1. schemathesis ---------------------------------------------------------------------------
def fuzz_schema(base_url: str | None, *, seed: int, max_examples: int, gen_tokens: int = 4,
                api_key: str | None = None, timeout: float = 60.0, app: Any = None,
                phases: tuple[str, ...] = ("coverage", "fuzzing")) -> dict:
    """schemathesis over every operation of /openapi.json at `base_url` (or of an ASGI `app`):
    its coverage phase (each documented bound and type, just inside and just outside) and its
    fuzzing phase (`max_examples` generated cases per operation and mode). Generated requests
    ask for at most `gen_tokens` tokens so that the run stays bounded."""
    import schemathesis
    from schemathesis.engine import from_schema

    config = schemathesis.Config.from_dict({
        "seed": seed, "continue-on-failure": True, "request-timeout": timeout,
        "headers": {"Authorization": f"Bearer {api_key}"} if api_key else {},
        "generation": {"max-examples": max_examples, "mode": "all"},
        "checks": {"enabled": False, **{name: {"enabled": True} for name in SCHEMA_CHECKS}},
        "phases": {name: {"enabled": name in phases}
                   for name in ("examples", "coverage", "fuzzing", "stateful")},
    })
    if app is not None:
        schema = schemathesis.openapi.from_asgi("/openapi.json", app, config=config)
    else:
        schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", config=config)
    statuses: Counter = Counter()
    cap = _generation_cap(schema.raw_schema, gen_tokens)

    def before_call(_context, case, _kwargs):  # every phase's requests, before they are sent
        case.body = cap(case.body)

    @schema.hook
    def after_call(_context, _case, response):
        statuses[response.status_code] += 1

    failures, phases = [], {}
    # schemathesis runs before_call hooks only from its global registry: registered for this run
    hooks = schemathesis.hooks.GLOBAL_HOOK_DISPATCHER
    hooks.register_hook_with_name(before_call, "before_call")
    try:
        for event in from_schema(schema).execute():
            kind = type(event).__name__
            if kind == "ScenarioFinished":
                failures.extend(_failures_of(event.recorder))
            elif kind == "PhaseFinished":
                phases[event.phase.name.value] = event.status.value
            elif kind in ("NonFatalError", "FatalError"):
                failures.append({"operation": getattr(event, "label", ""), "check": kind,
                                 "title": str(getattr(event, "info", event))[:500]})
    finally:
        hooks.unregister(before_call)
    return {"requests": sum(statuses.values()), "statuses": _by_status(statuses),
            "phases": phases, "failures": _dedup(failures)}


def _generation_cap(raw_schema: dict, gen_tokens: int):
    """A body mapper: max_tokens / max_completion_tokens / max_output_tokens within the
    documented range become at most `gen_tokens` (absent: `gen_tokens`), n at most MAX_FUZZ_N;
    anything out of range is left for the server, so valid bodies stay valid and invalid ones
    invalid."""
    schemas = raw_schema["components"]["schemas"]

    def documented_max(model: str, field: str) -> int:
        return max(b.get("maximum", 0) for b in schemas[model]["properties"][field]["anyOf"])
    limits = {"max_tokens": (gen_tokens, documented_max("CompletionRequest", "max_tokens")),
              "max_completion_tokens": (gen_tokens, documented_max("ChatCompletionRequest",
                                                                   "max_completion_tokens")),
              "max_output_tokens": (gen_tokens, documented_max("ResponsesRequest",
                                                               "max_output_tokens")),
              "n": (MAX_FUZZ_N, documented_max("CompletionRequest", "n"))}

    def cap(body: Any) -> Any:
        if not isinstance(body, dict):
            return body
        if all(body.get(k) is None for k in limits if k != "n"):
            # /v1/responses names it max_output_tokens (/v1/embeddings, the other body
            # with `input`, generates nothing and ignores it)
            body["max_output_tokens" if "input" in body else "max_tokens"] = gen_tokens
        for key, (most, top) in limits.items():
            value = body.get(key)
            if type(value) is int and most < value <= top:
                body[key] = most
        return body
    return cap


def _failures_of(recorder) -> list[dict]:
    out = []
    for checks in recorder.checks.values():
        for check in checks:
            if check.failure_info is not None:
                failure = check.failure_info.failure
                out.append({"operation": recorder.label, "check": check.name,
                            "title": failure.title, "message": str(failure.message)[:500],
                            "curl": check.failure_info.code_sample[:2000]})
    return out


def _dedup(failures: list[dict]) -> list[dict]:
    seen, out = set(), []
    for f in failures:
        key = (f["operation"], f["check"], f["title"])
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out


def _by_status(counts: Counter) -> dict[str, int]:
    return {str(k): counts[k] for k in sorted(counts, key=str)}


# -- raw HTTP/1.1 over asyncio streams ----------------------------------------------------------
class Target:
    def __init__(self, base_url: str, api_key: str | None, model: str):
        url = urlsplit(base_url)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        self.api_key, self.model = api_key, model

    def request(self, path: str, body: bytes | None, *, method: str = "POST",
                extra_headers: str = "", content_length: int | None = None) -> bytes:
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
        if self.api_key:
            head += f"Authorization: Bearer {self.api_key}\r\n"
        if body is not None:
            head += "Content-Type: application/json\r\n"
            head += f"Content-Length: {len(body) if content_length is None else content_length}\r\n"
        head += extra_headers + "Connection: close\r\n\r\n"
        return head.encode() + (body or b"")

    def completion(self, *, stream: bool = False, max_tokens: int = 2) -> bytes:
        body = {"model": self.model, "prompt": "Hello, my name is", "max_tokens": max_tokens,
                "temperature": 0, "stream": stream}
        if stream:
            body["ignore_eos"] = True
        return json.dumps(body).encode()

    async def connect(self):
        return await asyncio.open_connection(self.host, self.port)


async def read_status(reader: asyncio.StreamReader, timeout: float) -> int | None:
    """The status code of the response's first line; None when the server closed first."""
    try:
        line = await asyncio.wait_for(reader.readline(), timeout)
    except (asyncio.TimeoutError, ConnectionError):
        return None
    parts = line.split()
    return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else None


async def read_response(reader: asyncio.StreamReader, timeout: float) -> tuple[int | None, bytes]:
    status = await read_status(reader, timeout)
    try:
        rest = await asyncio.wait_for(reader.read(), timeout)
    except (asyncio.TimeoutError, ConnectionError):
        rest = b""
    return status, rest


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        await writer.wait_closed()
    except (ConnectionError, OSError):
        pass


# -- 2. slow clients ------------------------------------------------------------------------------
async def slow_clients(target: Target, *, clients: int, seconds: float, timeout: float) -> dict:
    """Each client sends a valid request a byte a second for `seconds`, then the rest at once;
    meanwhile a normal request must be answered."""
    request = target.request("/v1/completions", target.completion())

    async def one() -> int | None:
        reader, writer = await target.connect()
        try:
            sent, start = 0, time.monotonic()
            while sent < len(request) and time.monotonic() - start < seconds:
                writer.write(request[sent:sent + 1])
                await writer.drain()
                sent += 1
                await asyncio.sleep(1.0)
            writer.write(request[sent:])
            await writer.drain()
            return (await read_response(reader, timeout))[0]
        finally:
            await _close(writer)

    tasks = [asyncio.ensure_future(one()) for _ in range(clients)]
    await asyncio.sleep(min(2.0, seconds / 2))
    meanwhile = await normal_completion(target, timeout)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    statuses = Counter(r if isinstance(r, int) else "no_response" for r in results)
    return {"requests": clients + 1, "statuses": _merge(statuses, Counter([meanwhile])),
            "served_while_slow": meanwhile == 200}


# -- 3. connections dropped mid-request -----------------------------------------------------------
async def dropped_connections(target: Target, *, connections: int, concurrency: int,
                              timeout: float) -> dict:
    """`connections` requests, `concurrency` at a time, each abandoned part-way (DROP_KINDS in
    turn); statuses are those read before dropping (only the streaming kind reads one)."""
    body = target.completion(stream=True, max_tokens=1000)
    statuses: Counter = Counter()
    kinds: Counter = Counter()
    errors: Counter = Counter()
    slots = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        kind = DROP_KINDS[i % len(DROP_KINDS)]
        async with slots:
            try:
                reader, writer = await target.connect()
            except OSError as exc:
                errors[type(exc).__name__] += 1
                return
            try:
                if kind == "headers_only":
                    writer.write(target.request("/v1/completions", b"", content_length=len(body)))
                elif kind == "half_body":
                    writer.write(target.request("/v1/chat/completions", b"",
                                                content_length=len(body)) + body[:len(body) // 2])
                else:
                    writer.write(target.request("/v1/completions", body))
                await writer.drain()
                if kind == "stream_first_chunk":
                    status = await read_status(reader, timeout)
                    statuses[status if status is not None else "no_response"] += 1
                    await asyncio.wait_for(reader.readuntil(b"data: "), timeout)
                kinds[kind] += 1
            except (ConnectionError, asyncio.TimeoutError, asyncio.IncompleteReadError) as exc:
                errors[type(exc).__name__] += 1
            finally:
                writer.transport.abort()  # RST, not a polite FIN: the rudest way to leave

    await asyncio.gather(*(one(i) for i in range(connections)))
    return {"requests": connections, "kinds": dict(kinds), "statuses": _by_status(statuses),
            "client_errors": dict(errors)}


# -- 4. oversized headers and bodies --------------------------------------------------------------
async def oversized(target: Target, *, max_request_bytes: int, timeout: float) -> dict:
    big = max_request_bytes + 1
    body = b'{"prompt": "' + b"x" * big + b'"}'
    cases = {
        "headers_64KiB_one": target.request("/v1/completions", target.completion(),
                                            extra_headers=f"X-Fuzz: {'a' * 65536}\r\n"),
        "headers_64KiB_many": target.request("/v1/completions", target.completion(), extra_headers=(
            "".join(f"X-Fuzz-{i}: {'b' * 54}\r\n" for i in range(1024)))),
        "request_line_64KiB": target.request("/v1/models?" + "q" * 65536, None, method="GET"),
        "body_declared_over_limit": target.request("/v1/completions", body),
        "body_chunked_over_limit": _chunked(target, body),
        "body_lying_content_length": target.request("/v1/completions", body, content_length=100),
    }
    statuses: dict[str, int | str] = {}
    for name, raw in cases.items():
        reader, writer = await target.connect()
        try:
            writer.write(raw)
            await writer.drain()
        except ConnectionError:
            pass  # the server may refuse and close before reading everything
        status, _ = await read_response(reader, timeout)
        statuses[name] = status if status is not None else "no_response"
        await _close(writer)
    return {"requests": len(cases), "cases": statuses,
            "statuses": _by_status(Counter(statuses.values()))}


def _chunked(target: Target, body: bytes) -> bytes:
    head = target.request("/v1/completions", None).replace(
        b"Connection: close", b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
                              b"Connection: close")
    step = 64 * 1024
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + step]), body[i:i + step])
                      for i in range(0, len(body), step))
    return head + chunks + b"0\r\n\r\n"


# -- 5. hostile fields (scripts/hostile_requests.py) ---------------------------------------------
async def hostile(target: Target, *, seed: int, timeout: float) -> dict:
    """Each generated case once: its status, whether the error names the field, its seconds."""
    import random
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import hostile_requests
    found: dict[str, dict] = {}
    for name, (body, field) in hostile_requests.cases(target.model, random.Random(seed)).items():
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        start = time.monotonic()
        reader, writer = await target.connect()
        try:
            writer.write(target.request("/v1/chat/completions", raw))
            await writer.drain()
            status, rest = await read_response(reader, timeout)
        finally:
            await _close(writer)
        found[name] = {"status": status if status is not None else "no_response",
                       "names_field": field is None or field.encode() in rest,
                       "bytes": len(raw), "seconds": round(time.monotonic() - start, 3)}
    refused = all(isinstance(c["status"], int) and 400 <= c["status"] < 500 and c["names_field"]
                  for c in found.values())
    return {"requests": len(found), "cases": found, "all_refused_naming_the_field": refused,
            "worst_seconds": max(c["seconds"] for c in found.values()),
            "statuses": _by_status(Counter(c["status"] for c in found.values()))}


# -- the checks after ------------------------------------------------------------------------------
async def normal_completion(target: Target, timeout: float) -> int | str:
    """The status of a plain completion ("no_response" when none came, "bad_body" for a 200
    without a completion in it)."""
    reader, writer = await target.connect()
    try:
        writer.write(target.request("/v1/completions", target.completion()))
        await writer.drain()
        status, rest = await read_response(reader, timeout)
    finally:
        await _close(writer)
    if status is None:
        return "no_response"
    return "bad_body" if status == 200 and b'"text_completion"' not in rest else status


async def engine_gauges(target: Target, timeout: float) -> dict[str, float]:
    reader, writer = await target.connect()
    try:
        writer.write(target.request("/metrics", None, method="GET"))
        await writer.drain()
        _, text = await read_response(reader, timeout)
    finally:
        await _close(writer)
    wanted = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")
    found = {}
    for line in text.decode(errors="replace").splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            found[name] = float(line.rsplit(" ", 1)[1])
    return found


async def settle(target: Target, timeout: float) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and no KV block is used (or `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        gauges = await engine_gauges(target, 30)
        if gauges and all(v == 0 for v in gauges.values()):
            return gauges
        if time.monotonic() > deadline:
            return gauges
        await asyncio.sleep(0.5)


def _merge(*counts: dict) -> dict[str, int]:
    """Counts by status added up; 200 and "200" are the same status."""
    total: Counter = Counter()
    for c in counts:
        total.update({str(k): n for k, n in c.items()})
    return _by_status(total)


def _server_errors(statuses: dict[str, int]) -> int:
    return sum(n for s, n in statuses.items() if s.isdigit() and int(s) >= 500)


# -- main -----------------------------------------------------------------------------------
PARTS = "schema,slow,drop,oversize,hostile"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True)
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    p.add_argument("--parts", default=PARTS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-examples", type=int, default=100, help="per operation and mode")
    p.add_argument("--schema-phases", default="coverage,fuzzing",
                   help="schemathesis phases to run (coverage sends ~400 cases whatever "
                        "--max-examples says)")
    p.add_argument("--gen-tokens", type=int, default=4, help="max_tokens of generated requests")
    p.add_argument("--slow-clients", type=int, default=8)
    p.add_argument("--slow-seconds", type=float, default=30.0)
    p.add_argument("--connections", type=int, default=10000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-request-bytes", type=int, default=1 << 20)
    p.add_argument("--timeout", type=float, default=120.0, help="per response")
    p.add_argument("--settle-timeout", type=float, default=60.0)
    p.add_argument("--no-store", action="store_true")
    return p.parse_args(argv)


def served_model(base_url: str, api_key: str | None) -> str:
    import httpx
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]


def run(args: argparse.Namespace) -> dict:
    base_url = args.base_url.rstrip("/")
    target = Target(base_url, args.api_key, args.model or served_model(base_url, args.api_key))
    parts = [p for p in args.parts.split(",") if p]
    result: dict[str, Any] = {"base_url": base_url, "seed": args.seed, "parts": {}}
    started = time.monotonic()
    for part in parts:
        t0 = time.monotonic()
        if part == "schema":
            out = fuzz_schema(base_url, seed=args.seed, max_examples=args.max_examples,
                              gen_tokens=args.gen_tokens, api_key=args.api_key,
                              timeout=args.timeout,
                              phases=tuple(args.schema_phases.split(",")))
        elif part == "slow":
            out = asyncio.run(slow_clients(target, clients=args.slow_clients,
                                           seconds=args.slow_seconds, timeout=args.timeout))
        elif part == "drop":
            out = asyncio.run(dropped_connections(target, connections=args.connections,
                                                  concurrency=args.concurrency,
                                                  timeout=args.timeout))
        elif part == "oversize":
            out = asyncio.run(oversized(target, max_request_bytes=args.max_request_bytes,
                                        timeout=args.timeout))
        elif part == "hostile":
            out = asyncio.run(hostile(target, seed=args.seed, timeout=args.timeout))
        else:
            raise SystemExit(f"unknown part {part!r}; choose from {PARTS}")
        out["seconds"] = round(time.monotonic() - t0, 1)
        result["parts"][part] = out
        print(f"[fuzz_api] {part}: {json.dumps(out)[:400]}", file=sys.stderr, flush=True)
    gauges = asyncio.run(settle(target, args.settle_timeout))
    after = asyncio.run(normal_completion(target, args.timeout))
    statuses = _merge(*(p["statuses"] for p in result["parts"].values()), Counter([after]))
    result.update({
        "requests": sum(p["requests"] for p in result["parts"].values()) + 1,
        "statuses": statuses, "server_errors_5xx": _server_errors(statuses),
        "schema_failures": len(result["parts"].get("schema", {}).get("failures", [])),
        "engine_after": gauges,
        "kv_cache_usage_after": gauges.get("vllm:kv_cache_usage_perc"),
        "requests_running_after": gauges.get("vllm:num_requests_running"),
        "next_request_status": after, "seconds": round(time.monotonic() - started, 1)})
    result["ok"] = (result["server_errors_5xx"] == 0 and result["schema_failures"] == 0
                    and bool(gauges) and all(v == 0 for v in gauges.values()) and after == 200
                    and result["parts"].get("slow", {}).get("served_while_slow", True)
                    and result["parts"].get("hostile", {}).get("all_refused_naming_the_field",
                                                               True))
    return result


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = run(args)
    if not args.no_store:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_record import store
        print(f"stored {store('fuzz_api', result, argv)}", file=sys.stderr)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
