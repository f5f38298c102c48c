"""What the scheduler process does with each message, without sockets.

`SchedulerService` turns client messages into `Scheduler` calls and scheduler outputs into
messages; the process module (`pipeline.scheduler_process`) only moves frames. Every `send_*`
is injected, so tests drive this with plain lists.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from pipeline import messages
from pipeline.scheduler import QueueFull, RequestRejected, Scheduler
from pipeline.sequence import Request, SequenceOutput

ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(slots=True)
class _Owned:
    client_id: bytes
    sampling: object
    num_prompt_tokens: int


class Histogram:
    """Cumulative bucket counts, the shape Prometheus wants."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                self.counts[i] += 1

    def to_dict(self) -> dict:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.sum,
                "count": self.count}


class SchedulerService:
    def __init__(self, scheduler: Scheduler, *, send_to_client: Callable[[bytes, object], None],
                 send_to_detok: Callable[[object], None], clock: Callable[[], float] = time.time):
        self.scheduler = scheduler
        self.send_to_client = send_to_client
        self.send_to_detok = send_to_detok
        self.clock = clock
        self.owners: dict[str, _Owned] = {}
        self.draining = False
        self.healthy = True
        self.iteration_tokens = Histogram(ITERATION_TOKEN_BUCKETS)

    # -- client messages ---------------------------------------------------------------------
    def on_add(self, client_id: bytes, msg: messages.AddRequest) -> None:
        if self.draining:
            self.send_to_client(client_id, messages.RequestRejected(
                msg.request_id, 503, "the server is shutting down and accepts no new requests"))
            return
        outputs = msg.output_token_ids[0] if msg.output_token_ids else []
        request = Request(msg.request_id, list(msg.prompt_token_ids), msg.sampling,
                          msg.arrival_time, msg.priority, msg.cache_salt, list(outputs))
        try:
            self.scheduler.add(request)
        except QueueFull as exc:
            self.send_to_client(client_id, messages.RequestRejected(msg.request_id, 503, exc.reason))
            return
        except RequestRejected as exc:
            self.send_to_client(client_id, messages.RequestRejected(msg.request_id, 400, exc.reason))
            return
        self.owners[msg.request_id] = _Owned(client_id, msg.sampling, len(msg.prompt_token_ids))
        self.send_to_detok(messages.DetokOpen(
            request_id=msg.request_id, client_id=client_id, prompt_token_ids=msg.prompt_token_ids,
            sampling=msg.sampling, text_offsets=msg.text_offsets))

    def on_abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._forward(self.scheduler.abort(rid), step_id=-1)

    def on_stop_matched(self, msg: messages.StopMatched) -> None:
        # The detokenizer already told the client; only the scheduler's state must follow.
        outputs = self.scheduler.stop(msg.request_id, "stop", msg.index)
        for out in outputs:
            if out.request_finished:
                self.owners.pop(out.request_id, None)

    def on_utility(self, client_id: bytes, msg: messages.UtilityCall) -> None:
        if msg.method == "stats":
            reply = messages.UtilityReply(msg.call_id, result=self.stats())
        elif msg.method == "health":
            reply = messages.UtilityReply(msg.call_id, result={
                "ok": self.healthy and not self.draining, "draining": self.draining})
        else:
            reply = messages.UtilityReply(msg.call_id, error=f"unknown utility method {msg.method!r}")
        self.send_to_client(client_id, reply)

    # -- steps ---------------------------------------------------------------------------------
    def on_step_result(self, plan: messages.StepPlan, result: messages.StepResult) -> None:
        outputs = self.scheduler.update(plan, result, self.clock())
        self.iteration_tokens.observe(sum(s.num_tokens for s in plan.scheduled))
        self._forward(outputs, plan.step_id)

    def _forward(self, outputs: list[SequenceOutput], step_id: int) -> None:
        if not outputs:
            return
        samples = []
        for out in outputs:
            owner = self.owners.get(out.request_id)
            if owner is None:
                continue
            stop_reason = None
            if out.finish_reason == "stop" and out.new_token_ids and \
                    out.new_token_ids[-1] in owner.sampling.stop_token_ids:
                stop_reason = out.new_token_ids[-1]
            samples.append(messages.SampleTokens(
                request_id=out.request_id, index=out.index, token_ids=out.new_token_ids,
                logprobs=out.logprobs, top_logprobs=out.top_logprobs,
                finish_reason=out.finish_reason, stop_reason=stop_reason,
                num_prompt_tokens=owner.num_prompt_tokens))
            if out.request_finished:
                del self.owners[out.request_id]
        if samples:
            self.send_to_detok(messages.TokenBatch(step_id, samples))

    def stats(self) -> dict:
        s = self.scheduler.stats()
        kv = self.scheduler.kv.stats()
        return {
            "num_requests_running": s.num_running, "num_requests_waiting": s.num_waiting,
            "num_requests_swapped": s.num_swapped, "kv_cache_usage_perc": s.kv_usage,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits, "num_preemptions": s.num_preemptions,
            "prompt_tokens": s.prompt_tokens, "generation_tokens": s.generation_tokens,
            "iteration_tokens": self.iteration_tokens.to_dict(),
            "kv_blocks_used": kv.gpu_blocks_used, "kv_blocks_total": kv.gpu_blocks_total,
            "cpu_blocks_used": kv.cpu_blocks_used, "cpu_blocks_total": kv.cpu_blocks_total,
            "num_unfinished_requests": len(self.scheduler.requests),
            "draining": self.draining,
        }
