"""What the scheduler process does with each message, without sockets: client messages into
`Scheduler` calls, scheduler outputs into messages. Every `send_*` is injected, so tests drive
this with plain lists; the process module only moves frames."""
from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter

from pagedserve.pipeline import messages
from pagedserve.pipeline.scheduler import QueueFull, RequestRejected, Scheduler
from pagedserve.pipeline.scheduler.sequence import Request, RequestState
from pagedserve.pipeline.scheduler.step_outputs import StepOutputs

ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# A finished request's share of its drafts that were accepted (n-gram speculation).
ACCEPTANCE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
CLIENT_TIMEOUT_S = 5.0  # a client silent this long (no heartbeat) is gone: abort its requests
# How long a finished request's outputs are kept for a re-feed: a detokenizer that died (or hung,
# found by its missing heartbeats) before delivering them gets them again from its successor.
RETAIN_FINISHED_S = 20.0
QUARANTINED_IDS = 1024  # request ids remembered as having ended the detokenizer


@dataclass(slots=True)
class _Owned:
    client_id: bytes
    sampling: object
    num_prompt_tokens: int


@dataclass(slots=True)
class _Finished:
    at: float
    owner: _Owned
    state: RequestState


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
                 send_to_detok: Callable[[object], None], clock: Callable[[], float] = time.time,
                 instance: str = "", client_timeout_s: float = CLIENT_TIMEOUT_S,
                 retain_finished_s: float = RETAIN_FINISHED_S, grammar_gate=None):
        self.scheduler = scheduler
        # Structured output: requests wait in the gate until their grammar is compiled.
        self.grammar_gate = grammar_gate
        self.send_to_client = send_to_client
        self.send_to_detok = send_to_detok
        self.clock = clock
        self.instance = instance  # changes when the scheduler restarts: clients resubmit
        self.client_timeout_s = client_timeout_s
        self.owners: dict[str, _Owned] = {}
        self.retain_finished_s = retain_finished_s
        self.finished: dict[str, _Finished] = {}  # in finishing order: the oldest first
        self.last_seen: dict[bytes, float] = {}
        self.draining = False
        self.roles_down: dict[str, str] = {}  # role -> cause, while it restarts
        self.iteration_tokens = Histogram(ITERATION_TOKEN_BUCKETS)
        self.request_acceptance = Histogram(ACCEPTANCE_BUCKETS)
        # Messages some role received and did not handle, by (role, type tag).
        self.unknown_messages: Counter[tuple[str, str]] = Counter()
        # Restarts by role since this scheduler started (the worker group counts once), and
        # the scheduler's own incarnation.
        self.restarts: Counter[str] = Counter()
        self.foreign_aborts = 0  # aborts a client sent for requests it does not own (ignored)
        self.quarantined: dict[str, str] = {}  # request id -> why (it ended the detokenizer)

    @property
    def healthy(self) -> bool:
        return not self.roles_down

    def handlers(self) -> dict[type, Callable]:
        """The messages this service takes, as a dispatch table: handler(msg, sender), the
        sender being the client's identity (None for the detokenizer and the launcher)."""
        return {
            messages.AddRequest: lambda msg, client_id: self.on_add(client_id, msg),
            messages.Abort: self._on_abort_message,
            messages.UtilityCall: lambda msg, client_id: self.on_utility(client_id, msg),
            messages.StopMatched: lambda msg, _sender: self.on_stop_matched(msg),
            messages.RoleRestarted: lambda msg, _sender: self.on_role_restarted(msg.role),
            messages.GroupFailed: lambda msg, _sender: self.fail_all(503, msg.message),
            messages.UnknownMessage: lambda msg, _sender: self.count_unknown(msg.role, msg.tag),
        }

    def _on_abort_message(self, msg: messages.Abort, client_id: bytes | None) -> None:
        """From a client: only its own requests (an id is no capability: any client could
        guess another's). From the detokenizer (no identity): any request."""
        if client_id is None:
            self.on_abort(msg.request_ids)
            return
        self.seen(client_id)
        own = [rid for rid in msg.request_ids
               if (owner := self.owners.get(rid)) is not None and owner.client_id == client_id]
        self.foreign_aborts += len(msg.request_ids) - len(own)
        self.on_abort(own)

    def on_role_restarted(self, role: str) -> None:
        self.roles_down.pop(role, None)
        if role == "detokenizer":
            self.refeed_detokenizer()

    def seen(self, client_id: bytes) -> None:
        self.last_seen[client_id] = self.clock()

    def on_add(self, client_id: bytes, msg: messages.AddRequest) -> None:
        self.seen(client_id)
        if msg.resubmitted and self._holds(client_id, msg.request_id):
            return  # the client could not tell whether we had it: we have
        if msg.request_id in self.quarantined:  # resubmitted before it heard of the failure
            self.send_to_client(client_id, messages.RequestFailed(
                msg.request_id, 500, self.quarantined[msg.request_id]))
            return
        if self.draining:
            self.send_to_client(client_id, messages.RequestRejected(
                msg.request_id, 503, "the server is shutting down and accepts no new requests"))
            return
        spec = msg.sampling.structured_outputs
        if spec is not None:
            if self.grammar_gate is None:
                self.send_to_client(client_id, messages.RequestRejected(
                    msg.request_id, 400, "structured output is not enabled in this engine"))
                return
            if not self.grammar_gate.ready(spec):
                self.grammar_gate.hold(msg.request_id, spec, (client_id, msg))
                return
        self._admit(client_id, msg)

    def _holds(self, client_id: bytes, request_id: str) -> bool:
        """This client's request is here: live, finished lately or waiting for its grammar."""
        finished = self.finished.get(request_id)
        owner = self.owners.get(request_id) or (finished.owner if finished else None)
        if owner is not None:
            return owner.client_id == client_id
        held = self.grammar_gate.held.get(request_id) if self.grammar_gate is not None else None
        return held is not None and held.payload[0] == client_id

    @property
    def compiling(self) -> bool:
        """Requests wait for their grammar: the loop should call admit_compiled soon."""
        return self.grammar_gate is not None and bool(self.grammar_gate.held)

    def admit_compiled(self) -> None:
        """Admit the requests whose grammar is now compiled; reject those whose compile
        failed or timed out (400, naming the problem)."""
        if not self.compiling:
            return
        ready, failed = self.grammar_gate.release()
        for held in ready:
            self._admit(*held.payload)
        for held, message in failed:
            client_id, _msg = held.payload
            self.send_to_client(client_id, messages.RequestRejected(held.request_id, 400, message))

    def _admit(self, client_id: bytes, msg: messages.AddRequest) -> None:
        outputs = msg.output_token_ids[0] if msg.output_token_ids else []
        request = Request(msg.request_id, list(msg.prompt_token_ids), msg.sampling,
                          msg.arrival_time, msg.priority, msg.cache_salt, list(outputs),
                          msg.pooling, msg.lora)
        try:
            self.scheduler.add(request)
        except RequestRejected as exc:  # a full queue (QueueFull) is 503: retry later
            status = 503 if isinstance(exc, QueueFull) else 400
            self.send_to_client(client_id, messages.RequestRejected(msg.request_id, status,
                                                                    exc.reason))
            return
        if (spec := msg.sampling.structured_outputs) is not None:
            self.scheduler.grammar_book.add(msg.request_id, self.grammar_gate.compiler.get(spec), spec)
        self.owners[msg.request_id] = _Owned(client_id, msg.sampling, len(msg.prompt_token_ids))
        self.send_to_detok(messages.DetokOpen(
            request_id=msg.request_id, client_id=client_id, prompt_token_ids=msg.prompt_token_ids,
            sampling=msg.sampling))
        if outputs:  # a resubmission: the detokenizer needs the text so far (clients dedupe)
            self.send_to_detok(messages.TokenBatch(-1, [messages.SampleTokens(
                request_id=msg.request_id, index=0, token_ids=list(outputs), offset=0,
                num_prompt_tokens=len(msg.prompt_token_ids))]))

    def on_abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self.grammar_gate is not None and self.grammar_gate.drop(rid):
                continue  # never admitted: nothing to finish
            self._forward(StepOutputs([], [], self.scheduler.abort(rid)), step_id=-1)

    def on_stop_matched(self, msg: messages.StopMatched) -> None:
        # The detokenizer already told the client; only the scheduler's state must follow.
        outputs = self.scheduler.stop(msg.request_id, "stop", msg.index)
        self._keep_finished()
        for out in outputs:
            if out.request_finished:
                self.owners.pop(out.request_id, None)

    def on_utility(self, client_id: bytes, msg: messages.UtilityCall) -> None:
        self.seen(client_id)
        if msg.method == "stats":
            reply = messages.UtilityReply(msg.call_id, result=self.stats())
        elif msg.method == "health":
            reply = messages.UtilityReply(msg.call_id, result={
                "ok": self.healthy and not self.draining, "draining": self.draining,
                "instance": self.instance, "down": dict(self.roles_down)})
        else:
            reply = messages.UtilityReply(msg.call_id, error=f"unknown utility method {msg.method!r}")
        self.send_to_client(client_id, reply)

    def count_restart(self, role: str) -> None:
        self.restarts[role] += 1

    def count_unknown(self, role: str, tag: str) -> None:
        self.unknown_messages[role, tag] += 1

    def abort_silent_clients(self) -> None:
        """Abort the requests of clients that stopped sending heartbeats (e.g. a dead ingress)."""
        now = self.clock()
        gone = {cid for cid, t in self.last_seen.items() if now - t > self.client_timeout_s}
        for cid in gone:
            del self.last_seen[cid]
        self.on_abort([rid for rid, o in self.owners.items() if o.client_id in gone])

    def quarantine(self, request_id: str, cause: str) -> None:
        """The detokenizer died working on this request (its breadcrumb named it): fail it
        alone, before the re-feed would hand it to the next detokenizer; a client's
        resubmission of it is failed too."""
        owner = self.owners.get(request_id)
        if owner is not None:
            self.on_abort([request_id])  # finishes it: a finished entry, popped below
            self.owners.pop(request_id, None)
        finished = self.finished.pop(request_id, None)
        client = owner or (finished.owner if finished is not None else None)
        self.quarantined[request_id] = (f"the detokenizer {cause} while working on this "
                                        "request; it is not retried (quarantined), and the "
                                        "server goes on")
        while len(self.quarantined) > QUARANTINED_IDS:
            self.quarantined.pop(next(iter(self.quarantined)))
        if client is not None:
            self.send_to_client(client.client_id, messages.RequestFailed(
                request_id, 500, self.quarantined[request_id]))

    def refeed_detokenizer(self) -> None:
        """A restarted detokenizer knows nothing: reopen every live request, and every one that
        finished lately (its end may have died with the old detokenizer), and send all of its
        output so far (clients drop what they already have, by offset)."""
        live = [(rid, owner, self.scheduler.requests.get(rid)) for rid, owner in self.owners.items()]
        done = [(rid, f.owner, f.state) for rid, f in self.finished.items()]
        for rid, owner, state in live + done:
            if state is None:
                continue
            prompt = state.seqs[0].token_ids[:state.num_prompt_tokens] if state.seqs else []
            self.send_to_detok(messages.DetokOpen(request_id=rid, client_id=owner.client_id,
                                                  prompt_token_ids=prompt, sampling=owner.sampling))
            samples = [messages.SampleTokens(
                request_id=rid, index=seq.index, token_ids=seq.output_token_ids, offset=0,
                finish_reason=seq.finish_reason, num_prompt_tokens=owner.num_prompt_tokens,
                embedding=seq.embedding) for seq in state.seqs]
            if samples:
                self.send_to_detok(messages.TokenBatch(-1, samples))

    def fail_requests(self, failed: list[tuple[str, str]], status: int = 500) -> None:
        """Requests the scheduler gave up on (already finished there): the detokenizer tells
        each owner why and forgets the request."""
        for request_id, message in failed:
            if self.owners.pop(request_id, None) is not None:
                self.send_to_detok(messages.RequestFailed(request_id, status, message))

    def fail_all(self, status: int, message: str) -> None:
        """Tell every client its requests cannot complete, and drop them."""
        for rid, owner in list(self.owners.items()):
            with contextlib.suppress(Exception):  # the client may be gone too
                self.send_to_client(owner.client_id, messages.RequestFailed(rid, status, message))
            self.scheduler.abort(rid)
        self.owners.clear()

    def on_step_result(self, plan: messages.StepPlan, result: messages.StepResult) -> None:
        outputs = self.scheduler.update(plan, result, self.clock())
        self.iteration_tokens.observe(plan.num_tokens)
        self._forward(outputs, plan.step_id)

    def _keep_finished(self) -> None:
        """Keep the requests that just finished for a while (see RETAIN_FINISHED_S), and let
        older ones go - unless the detokenizer is down: then everything stays until its
        successor has been re-fed."""
        now = self.clock()
        for state in self.scheduler.take_finished():
            if state.num_drafted:
                self.request_acceptance.observe(state.num_accepted / state.num_drafted)
            owner = self.owners.get(state.request_id)
            if owner is not None:
                self.finished[state.request_id] = _Finished(now, owner, state)
        if "detokenizer" in self.roles_down:
            return
        while self.finished:
            rid, oldest = next(iter(self.finished.items()))
            if now - oldest.at <= self.retain_finished_s:
                break
            del self.finished[rid]

    def _forward(self, outputs: StepOutputs, step_id: int) -> None:
        """Hand a step's new tokens to the detokenizer: the columns (one token each, nothing
        finished, no logprobs) as columns again, the rest one SampleTokens each. Requests
        whose client is gone are dropped here or, in the columns, by the detokenizer (it
        knows no such request)."""
        self._keep_finished()
        batch = messages.TokenBatch(step_id, [])
        seqs = outputs.seqs
        if seqs:
            batch.request_ids = [seq.request.request_id for seq in seqs]
            batch.indices = list(map(attrgetter("index"), seqs))
            batch.token_ids = outputs.token_ids
            batch.offsets = [len(seq.token_ids) - seq.num_prompt_tokens - 1 for seq in seqs]
        batch.prompt_logprobs = [(rid, chunk) for rid, chunk in outputs.prompt_logprobs
                                 if rid in self.owners]
        samples = batch.samples
        for out in outputs.others:
            owner = self.owners.get(out.request_id)
            if owner is None:
                continue
            stop_reason = None
            if out.finish_reason == "stop" and out.new_token_ids and \
                    out.new_token_ids[-1] in owner.sampling.stop_token_ids:
                stop_reason = out.new_token_ids[-1]
            samples.append(messages.SampleTokens(
                request_id=out.request_id, index=out.index, token_ids=out.new_token_ids,
                offset=out.offset, logprobs=out.logprobs, top_logprobs=out.top_logprobs,
                finish_reason=out.finish_reason, stop_reason=stop_reason,
                num_prompt_tokens=owner.num_prompt_tokens, embedding=out.embedding))
            if out.request_finished:
                del self.owners[out.request_id]
        if samples or seqs or batch.prompt_logprobs:
            self.send_to_detok(batch)

    def stats(self) -> dict:
        s, kv, gate = self.scheduler.stats(), self.scheduler.kv.stats(), self.grammar_gate
        spec = {} if self.scheduler.proposer is None else {
            "spec_decode_num_drafts": s.spec_num_drafts,
            "spec_decode_num_draft_tokens": s.spec_draft_tokens,
            "spec_decode_num_accepted_tokens": s.spec_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(s.spec_accepted_per_pos),
            "spec_decode_request_acceptance": self.request_acceptance.to_dict()}
        tiers = self.scheduler.kv.tiers
        if tiers is not None:
            spec |= tiers.stats()
        if self.scheduler.config.max_loras:
            spec |= self.scheduler.queues.lora_stats(self.scheduler.config.max_loras)
        return spec | {
            "num_requests_running": s.num_running, "num_requests_waiting": s.num_waiting,
            "num_requests_swapped": s.num_swapped, "kv_cache_usage_perc": s.kv_usage,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits, "num_preemptions": s.num_preemptions,
            "prompt_tokens": s.prompt_tokens, "generation_tokens": s.generation_tokens,
            "steps_planned_ahead": self.scheduler.num_steps_ahead,  # overlapped scheduling
            "iteration_tokens": self.iteration_tokens.to_dict(),
            "kv_blocks_used": kv.gpu_blocks_used, "kv_blocks_total": kv.gpu_blocks_total,
            "cpu_blocks_used": kv.cpu_blocks_used, "cpu_blocks_total": kv.cpu_blocks_total,
            "num_unfinished_requests": len(self.scheduler.requests),
            "draining": self.draining,
            "restarts": dict(self.restarts), "foreign_aborts": self.foreign_aborts,
            "unknown_messages": [{"role": role, "type": tag, "count": n}
                                 for (role, tag), n in sorted(self.unknown_messages.items())],
            # seconds each grammar took to compile (structured output), in compile order
            "grammar_compile_s": list(gate.compiler.compile_seconds[-1000:]) if gate else [],
            "num_requests_compiling": len(gate.held) if gate else 0,
            "grammar_tables_ready": bool(gate and gate.compiler.ready),
            "grammar_compiler_warm": bool(gate and gate.compiler.warmed),
        }
