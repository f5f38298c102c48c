"""Each constrained sequence's grammar matcher, owned by the scheduler, and the step's masks.

The matcher state is a function of the sequence's output tokens: before a sequence samples, its
matcher takes whatever tokens it has not seen yet. So a recompute after preemption, a swap, a
worker group restart (the tokens stay with the scheduler) and a scheduler restart (the client
resubmits its tokens; a fresh matcher replays them) all continue from exactly the same state,
and a forked sample starts its own matcher from the same history. A token the grammar rejects
(it cannot happen for a masked sample; a resubmitted stream from another engine could) ends the
constraint for that sequence, logged, rather than the step.

`masks` packs one row per sampling sequence into a bitmask [rows, ceil(vocab / 32)] of int32
(bit t of a row allows token t), the plan's GrammarMasks; the workers apply it in one op. Each
row also goes through the Utf8Guard, so constrained output is always valid UTF-8.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from pagedserve.pipeline.messages import GrammarMasks
from pagedserve.pipeline.structured.utf8_guard import Utf8Guard

log = logging.getLogger(__name__)


class _Tracked:
    __slots__ = ("matcher", "num_seen", "broken", "start")

    def __init__(self, matcher, start: int) -> None:
        self.matcher = matcher
        self.start = start  # the first output token it constrains (after a model's thinking)
        self.num_seen = start  # output tokens accepted so far (counted from the first)
        self.broken = False


def answer_start(outputs: list[int], think_start: list[int], think_end: list[int]) -> int | None:
    """Where the answer begins in `outputs`: 0 without thinking, after `think_end` once it was
    generated, None while the model may still be thinking."""
    if not think_end:
        return 0
    n = len(think_start)
    if n:
        if outputs[:n] != think_start[:len(outputs)]:
            return 0  # it did not open a thinking block: all of it is the answer
        if len(outputs) < n:
            return None
    m = len(think_end)
    for i in range(n, len(outputs) - m + 1):
        if outputs[i:i + m] == think_end:
            return i + m
    return None


class GrammarBook:
    """Matchers by sequence id, for the requests whose compiled grammar `add` registered."""

    def __init__(self, vocab_size: int, utf8_guard: Callable[[], Utf8Guard | None] | None = None
                 ) -> None:
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self.grammars: dict[str, object] = {}  # request id -> xgrammar CompiledGrammar
        self.thinking: dict[str, tuple[list[int], list[int]]] = {}  # (think_start, think_end)
        self.matchers: dict[int, _Tracked] = {}
        # the compiler's (built with its vocabulary, off the step loop); else, here, from the
        # first grammar's vocabulary
        self._utf8_guard_source = utf8_guard
        self._utf8_guard: Utf8Guard | None = None

    def add(self, request_id: str, compiled, spec=None) -> None:
        self.grammars[request_id] = compiled
        if spec is not None and spec.think_end:
            self.thinking[request_id] = (list(spec.think_start), list(spec.think_end))

    def forget(self, request_id: str, seq_ids) -> None:
        """The request finished: its grammar and its sequences' matchers go."""
        self.grammars.pop(request_id, None)
        self.thinking.pop(request_id, None)
        for sid in seq_ids:
            self.matchers.pop(sid, None)

    def masks(self, requests: dict, step_id: int, running) -> GrammarMasks | None:
        """The masks of the constrained sequences that sample in step `step_id`: planned in it
        (last_step) and computing up to their last token (a lane, or a chunk that ends it)."""
        seqs = []
        for rid in self.grammars:
            req = requests.get(rid)
            if req is None:
                continue
            for seq in req.seqs:
                if seq.status is not running or seq.last_step != step_id:
                    continue
                n = len(seq.token_ids)
                if seq.num_computed_tokens == n or seq.num_computed_tokens + seq.step_tokens == n:
                    seqs.append(seq)
        if not seqs:
            return None
        tracked = [self._synced(seq) for seq in seqs]
        keep = [i for i, t in enumerate(tracked) if t is not None and not t.broken]
        if not keep:
            return None
        import torch  # here, not at import: a scheduler that never sees a grammar never loads it
        bitmask = torch.full((len(keep), self.num_words), -1, dtype=torch.int32)
        ids = []
        guard = self._guard()
        for row, i in enumerate(keep):
            tracked[i].matcher.fill_next_token_bitmask(bitmask, row)
            if guard is not None:
                t, seq = tracked[i], seqs[i]
                answered = t.num_seen > t.start
                guard.apply(bitmask[row], seq.token_ids[-1] if answered else None)
            ids.append(seqs[i].seq_id)
        return GrammarMasks(ids, self.num_words, bitmask.numpy().tobytes())

    def _guard(self) -> Utf8Guard | None:
        if self._utf8_guard is None and self._utf8_guard_source is not None:
            self._utf8_guard = self._utf8_guard_source()
        if self._utf8_guard is None:
            info = next((getattr(g, "tokenizer_info", None) for g in self.grammars.values()), None)
            if info is not None:  # xgrammar's; test doubles have none
                self._utf8_guard = Utf8Guard(info.decoded_vocab, self.num_words)
        return self._utf8_guard

    def _synced(self, seq) -> _Tracked | None:
        """The sequence's matcher, having accepted every output token of its answer; None
        while it is still thinking (nothing is constrained yet)."""
        tracked = self.matchers.get(seq.seq_id)
        outputs = seq.token_ids[seq.num_prompt_tokens:]
        if tracked is None:
            rid = seq.request.request_id
            start = answer_start(outputs, *self.thinking.get(rid, ([], [])))
            if start is None:
                return None
            import xgrammar as xgr
            tracked = self.matchers[seq.seq_id] = _Tracked(xgr.GrammarMatcher(self.grammars[rid]), start)
        for token in outputs[tracked.num_seen:]:
            if tracked.broken:
                break
            if tracked.matcher.is_terminated() or not tracked.matcher.accept_token(token):
                log.warning("seq %d: token %d is outside its grammar; unconstrained from here",
                            seq.seq_id, token)
                tracked.broken = True
        tracked.num_seen = len(outputs)
        return tracked
