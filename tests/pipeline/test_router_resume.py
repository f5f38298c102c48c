"""A stream whose replica breaks mid-way continues on another from the tokens already sent:
the router's service against fake replicas (httpx.MockTransport), no processes."""
import asyncio
import json

import httpx

from pagedserve.pipeline.router.core import Replica, RouterCore
from pagedserve.pipeline.router.delivery import Delivery
from pagedserve.pipeline.router.metrics import RouterMetrics
from pagedserve.pipeline.router.model_slots import ModelSlots
from pagedserve.pipeline.router.models import ModelManager
from pagedserve.pipeline.router.pool import ReplicaPool
from pagedserve.pipeline.router.ratelimit import RateLimiter
from pagedserve.pipeline.router.resume import ResumableStream
from pagedserve.pipeline.router.service import RouterService
from pagedserve.pipeline.router.upstream import DONE

PROMPT_IDS = [1, 2, 3]
WORDS = ["a", " b", " c", " d", " e", " f"]  # token i is 10 + i with text WORDS[i]


def sse(events):
    return b"".join(b"data: " + (e.encode() if e == "[DONE]" else json.dumps(e).encode())
                    + b"\n\n" for e in events)


def chat_chunks(start, stop, *, first=True, finish_at=None):
    out = []
    if first:
        out.append({"id": "c1", "created": 7, "model": "m", "object": "chat.completion.chunk",
                    "prompt_token_ids": PROMPT_IDS,
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    for i in range(start, stop):
        out.append({"id": "c1", "created": 7, "model": "m", "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": {"content": WORDS[i]}, "token_ids": [10 + i],
                                 "finish_reason": "length" if i == finish_at else None}]})
    return out


class Broken(httpx.AsyncByteStream):
    """A body that sends some events, then the connection drops."""

    def __init__(self, data):
        self.data = data

    async def __aiter__(self):
        yield self.data
        raise httpx.RemoteProtocolError("peer closed connection")


def make_service(handler):
    core = RouterCore()
    for rid in ("m/0", "m/1"):
        core.add(Replica(rid, "m", f"http://{rid.replace('/', '-')}", healthy=True,
                         max_model_len=100, upstream_model="m"))
    metrics = RouterMetrics()
    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    pool = ReplicaPool(core, metrics, http)
    models = ModelManager({}, ModelSlots(["m"]), pool, metrics)
    models.mark_loaded("m")
    return RouterService(core, pool, models, RateLimiter({}), metrics, http), core, metrics


def test_a_broken_chat_stream_resumes_on_the_other_replica_without_loss_or_repeat():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.host, request.url.path, body))
        if request.url.path == "/v1/chat/completions":  # the first replica: 2 tokens, then dies
            return httpx.Response(200, stream=Broken(sse(chat_chunks(0, 2))))
        done = len(body["prompt"]) - len(PROMPT_IDS)
        chunks = [{"id": "cmpl-x", "choices": [{"index": 0, "text": WORDS[i], "token_ids": [10 + i],
                                                "finish_reason": "length" if i == 5 else None}]}
                  for i in range(done, 6)]
        chunks[0]["choices"][0]["prompt_token_ids"] = body["prompt"]
        return httpx.Response(200, content=sse(chunks + ["[DONE]"]))

    async def run():
        service, core, metrics = make_service(handler)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        return [e async for e in service.stream(service.route("chat", body, ""))], core, metrics

    events, core, metrics = asyncio.run(run())
    assert events[-1] == DONE
    text = "".join(c["delta"].get("content", "") for e in events[:-1] for c in e["choices"])
    assert text == "".join(WORDS)
    # the continuation: prompt + the 2 tokens sent, 4 more owed, the same sampling
    (_, _, first), (_, path, cont) = seen
    assert first["return_token_ids"] is True and path == "/v1/completions"
    assert cont["prompt"] == PROMPT_IDS + [10, 11] and cont["max_tokens"] == 4
    assert cont["temperature"] == 0 and cont["stream"] is True
    # the client sees the original stream's shape and ids, no token ids it did not ask for
    assert {e["id"] for e in events[:-1]} == {"c1"}
    assert all("token_ids" not in c for e in events[:-1] for c in e["choices"])
    assert events[-2]["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    assert metrics.retries.labels("m")._value.get() == 1
    assert sum(not r.healthy for r in core.replicas.values()) == 1  # the broken one, until checked


def test_a_stream_that_cannot_resume_ends_with_an_error_event():
    def handler(request):
        return httpx.Response(200, stream=Broken(sse(chat_chunks(0, 2))))

    async def run():
        service, _, _ = make_service(handler)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2,
                "stream": True}
        return [e async for e in service.stream(service.route("chat", body, ""))]

    events = asyncio.run(run())
    assert events[-1] == DONE and "n > 1" in events[-2]["error"]["message"]


def test_continuation_body_for_a_completion_without_max_tokens():
    state = ResumableStream("completion", {"model": "m", "prompt": "hi", "stream": True,
                                           "seed": 5, "presence_penalty": None})
    state.feed({"id": "x", "choices": [{"index": 0, "text": "a", "token_ids": [7],
                                        "prompt_token_ids": [1, 2]}]})
    assert state.why_not_resumable() is None
    body = state.continuation_body("m", 100)
    assert body["prompt"] == [1, 2, 7] and body["max_tokens"] == 15  # OpenAI's default is 16
    assert body["seed"] == 5 and "presence_penalty" not in body
    penalized = ResumableStream("completion", {"prompt": "hi", "frequency_penalty": 0.5})
    penalized.prompt_token_ids = [1]
    assert "frequency_penalty" in penalized.why_not_resumable()
    for name in ("prompt_logprobs", "logprobs"):  # 0 asks for them too
        asking = ResumableStream("completion", {"prompt": "hi", name: 0})
        asking.prompt_token_ids = [1]
        assert name in asking.why_not_resumable()


def test_an_overloaded_replica_is_skipped_and_overload_everywhere_is_a_503_with_retry_after():
    asked = []

    def handler(request):
        asked.append(request.url.host)
        if request.url.host == "m-0" and len(asked) > 2:  # m-0 has room again later
            return httpx.Response(200, content=json.dumps({"choices": [], "usage": {
                "total_tokens": 3}}))
        return httpx.Response(503, headers={"Retry-After": "7"}, content=json.dumps(
            {"error": {"message": "The server is overloaded", "type": "server_error"}}))

    async def run():
        service, _, _ = make_service(handler)
        routed = service.route("completion", {"model": "m", "prompt": "hi"}, "")
        first = await service.complete(routed)
        second = await service.complete(routed)
        return first, second

    (status, _, headers), (status2, _, _) = asyncio.run(run())
    assert status == 503 and headers == {"retry-after": "7"}
    assert sorted(asked[:2]) == ["m-0", "m-1"]  # both were tried before giving up
    assert status2 == 200


def test_delivery_confirms_a_token_once_all_its_text_was_sent():
    plain = Delivery([])
    plain.sent([10], "a")
    plain.sent([11], "")           # held: the first bytes of a character
    assert (plain.confirmed_ids, plain.tail_ids, plain.tail_text) == ([10], [11], "")
    plain.sent([12], "é")          # released with the next token's text
    assert (plain.confirmed_ids, plain.tail_ids) == ([10, 11, 12], [])

    stops = Delivery(["\n\n"])     # text that may begin "\n\n" is held by the replica
    stops.sent([10], "a")
    assert stops.confirmed_ids == [] and stops.tail_text == "a"
    stops.sent([11], " b")         # what follows "a" starts with no stop's first character
    assert (stops.confirmed_ids, stops.tail_ids, stops.tail_text) == ([10], [11], " b")
    stops.sent([12], "")
    stops.sent([13], "\nc")        # "\n" may have been held at the end of " b"'s chunk
    assert (stops.confirmed_ids, stops.tail_ids, stops.tail_text) == ([10], [11, 12, 13],
                                                                      " b\nc")
    stops.sent([14], " d")
    assert (stops.confirmed_ids, stops.tail_ids, stops.tail_text) == ([10, 11, 12, 13], [14],
                                                                      " d")
    assert stops.num_tokens == 5


STOP_WORDS = {10: "a", 11: " b", 12: "\n", 13: "c", 14: " d"}


def _completion_chunks(ids_and_texts, finish_last=True):
    out = [{"id": "cmpl-x", "choices": [{"index": 0, "text": text, "token_ids": ids,
                                         "finish_reason": None}]} for ids, text in ids_and_texts]
    if finish_last:
        out[-1]["choices"][0]["finish_reason"] = "length"
    return out


def _held_newline_run(continuation):
    """The first replica sends "a", " b", then token 12 ("\\n", held: it may begin the stop
    string "\\n\\n") and dies; `continuation` answers the resumed request."""
    seen = []

    def handler(request):
        body = json.loads(request.content)
        seen.append(body)
        if request.url.path == "/v1/chat/completions":
            first = chat_chunks(0, 0)
            first += [{"id": "c1", "created": 7, "model": "m", "object": "chat.completion.chunk",
                       "choices": [{"index": 0, "delta": {"content": text} if text else {},
                                    "token_ids": [tid], "finish_reason": None}]}
                      for tid, text in ((10, "a"), (11, " b"), (12, ""))]
            return httpx.Response(200, stream=Broken(sse(first)))
        return httpx.Response(200, content=sse(continuation + ["[DONE]"]))

    async def run():
        service, _, _ = make_service(handler)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                "temperature": 0, "stop": ["\n\n"], "stream": True}
        return [e async for e in service.stream(service.route("chat", body, ""))]

    return asyncio.run(run()), seen


def test_text_the_replica_held_back_for_a_stop_string_is_not_lost_on_resume():
    events, seen = _held_newline_run(_completion_chunks(
        [([11], " b"), ([12], ""), ([13], "\nc"), ([14], " d")]))
    text = "".join(c["delta"].get("content", "") for e in events[:-1] for c in e["choices"])
    assert text == "a b\nc d"  # resuming after token 12 would have lost its "\n"
    cont = seen[1]
    assert cont["prompt"] == PROMPT_IDS + [10] and cont["max_tokens"] == 4
    assert cont["stop"] == ["\n\n"]
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-1] == DONE


def test_a_continuation_that_repeats_the_tail_differently_ends_the_stream_with_an_error():
    events, _ = _held_newline_run(_completion_chunks([([11], " x"), ([12], "")]))
    assert events[-1] == DONE and "diverged" in events[-2]["error"]["message"]
    text = "".join(c["delta"].get("content", "") for e in events[:-2] for c in e["choices"])
    assert text == "a b"  # nothing of the diverged continuation reached the client


def test_a_constrained_or_shaped_stream_is_not_resumed_but_ends_naming_the_cause():
    def run(extra, deltas):
        def handler(request):
            if request.url.path == "/v1/completions":  # a continuation: one token, finished
                return httpx.Response(200, content=sse(_completion_chunks([([20], "}")])
                                                       + ["[DONE]"]))
            first = chat_chunks(0, 0) + [
                {"id": "c1", "choices": [{"index": 0, "delta": d, "token_ids": [10 + i]}]}
                for i, d in enumerate(deltas)]
            return httpx.Response(200, stream=Broken(sse(first)))

        async def go():
            service, _, _ = make_service(handler)
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                    "stream": True, **extra}
            return [e async for e in service.stream(service.route("chat", body, ""))]
        events = asyncio.run(go())
        assert events[-1] == DONE
        return events[-2].get("error", {}).get("message", "resumed")

    text = [{"content": "{"}]
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    assert "constrained by response_format" in run({"response_format": schema}, text)
    assert "constrained by structured_outputs" in run({"structured_outputs": {"regex": "a+"}},
                                                      text)
    assert "constrained by guided_choice" in run({"guided_choice": ["a", "b"]}, text)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert "constrained by tools" in run({"tools": tools}, text)
    assert "reasoning_content" in run({}, [{"reasoning_content": "hmm"}])
    assert run({"response_format": {"type": "text"}, "tools": tools, "tool_choice": "none"},
               text) == "resumed"  # neither constrains the output
