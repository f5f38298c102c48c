"""A fake worker group for scheduler tests.

It rebuilds every sequence's state from the plans alone (as a real worker must), keeps a fake KV
pool whose slots hold the token id computed there, applies swaps and copies to it, and samples
from the history it reads back out of the pool. The next token is a deterministic function of
(seq_id, full token history), so a wrong diff, block id, copy, swap or prefix-cache hit shows up
either as an AssertionError here or as different tokens from the reference `expected_tokens`.

With a sliding window W the fake model reads only the last W positions (and the position
itself), as a windowed model's attention does: the blocks before the window may have been
released and reused, and every block table entry must still be a valid block id.
"""
from __future__ import annotations

import zlib
from array import array

import numpy as np

from pagedserve.pipeline import pooling
from pagedserve.pipeline.messages import StepPlan, StepResult


def next_token(salt: int, history: list[int], vocab: int) -> int:
    return zlib.crc32(array("q", history).tobytes(), salt) % vocab


def window_next_token(salt: int, history: list[int], vocab: int, window: int) -> int:
    """The fake model's next token: of the whole history, or of the last `window` tokens and
    the position under a sliding window."""
    if not window:
        return next_token(salt, history, vocab)
    return next_token(salt, [len(history)] + history[-window:], vocab)


def copying_next_token(salt: int, history: list[int], vocab: int, window: int = 0) -> int:
    """A fake model that mostly repeats what came PERIOD tokens back (two times in three), so
    n-gram drafts are often right and sometimes wrong."""
    period = 5
    h = zlib.crc32(array("q", history).tobytes(), salt)
    if h % 3 and len(history) >= period:
        return history[-period]
    return h % vocab


def expected_tokens(prompt: list[int], num_tokens: int, vocab: int, salt: int = 0,
                    stop_ids=(), min_tokens: int = 0, window: int = 0,
                    model=window_next_token) -> list[int]:
    """What a sequence generates when nothing goes wrong (stops at a stop id after min_tokens)."""
    history, out = list(prompt), []
    while len(out) < num_tokens:
        tok = model(salt, history, vocab, window)
        history.append(tok)
        out.append(tok)
        if tok in stop_ids and len(out) >= min_tokens:
            break
    return out


class _SeqState:
    __slots__ = ("tokens", "table", "num_computed", "salt", "pool")

    def __init__(self, tokens, table, num_computed, salt, pool=False):
        self.tokens, self.table, self.num_computed, self.salt = tokens, table, num_computed, salt
        self.pool = pool  # an embedding prompt: pooled (its KV read back), never sampled


def fake_embedding(tokens: list[int]) -> bytes:
    """The fake model's pooled vector of a prompt: its tokens as float32, then their count."""
    return pooling.to_bytes(np.array(tokens + [len(tokens)], dtype=np.float32))


class FakeWorker:
    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int,
                 vocab: int = 1000, salt_of=None, window: int = 0,
                 model=window_next_token) -> None:
        self.model = model  # model(salt, history, vocab, window) -> the next token
        self.verified: list[tuple[int, int]] = []  # (drafts, accepted) of each verification
        self.accepted_drafts: list[list[int]] = []  # the drafts each verification accepted
        self.bs = block_size
        self.vocab = vocab
        self.window = window
        self.gpu = [[None] * block_size for _ in range(num_gpu_blocks)]
        self.cpu = [[None] * block_size for _ in range(num_cpu_blocks)]
        self.seqs: dict[int, _SeqState] = {}
        # salt_of(seq_id) -> the sampling salt; by default all samples of a request differ.
        self.salt_of = salt_of or (lambda seq_id: 0)
        self.sampled_positions: list[tuple[int, int]] = []  # (seq_id, len(history)) sampled
        self.script: dict[int, list[int]] = {}  # seq_id -> tokens to return instead, in order

    def execute(self, plan: StepPlan) -> StepResult:
        for sid in plan.finished_seq_ids:
            del self.seqs[sid]
        for ns in plan.new_seqs:
            self.seqs[ns.seq_id] = _SeqState(ns.prompt_token_ids + ns.output_token_ids,
                                             list(ns.block_ids), ns.num_computed_tokens,
                                             self.salt_of(ns.seq_id), ns.pool)
        for src, dst in plan.swap_out:
            self.cpu[dst] = list(self.gpu[src])
        for src, dst in plan.swap_in:
            self.gpu[dst] = list(self.cpu[src])
        for src, dst in plan.copy:
            self.gpu[dst] = list(self.gpu[src])
        seq_ids, token_ids, accepted = [], [], []
        pooled_ids, pooled = [], []
        self.pooled_steps = getattr(self, "pooled_steps", [])
        assert len(plan.decode_seq_ids) == len(plan.decode_token_ids)
        for i, s in enumerate(plan.seq_steps()):  # the decode columns first
            st = self.seqs[s.seq_id]
            if i < len(plan.decode_seq_ids):
                assert st.num_computed == len(st.tokens), f"decode of {s.seq_id} is not its last token"
            st.table.extend(s.new_block_ids)
            st.tokens.extend(s.new_token_ids)
            st.num_computed += s.num_skipped  # drafts it accepted last step
            end = st.num_computed + s.num_tokens
            drafts = s.draft_token_ids
            assert end <= len(st.tokens), f"seq {s.seq_id} computes past its known tokens"
            assert end + len(drafts) <= len(st.table) * self.bs, \
                f"seq {s.seq_id} computes past its blocks"
            for pos, token in enumerate(st.tokens[st.num_computed:end] + drafts, st.num_computed):
                self.gpu[st.table[pos // self.bs]][pos % self.bs] = token
            st.num_computed = end
            if end == len(st.tokens) and st.pool:
                seen = [self.gpu[st.table[p // self.bs]][p % self.bs] for p in range(end)]
                assert seen == st.tokens, f"seq {s.seq_id}: the pool holds {seen}"
                pooled_ids.append(s.seq_id)
                pooled.append(fake_embedding(st.tokens))
                self.pooled_steps.append((s.seq_id, s.num_tokens))
            elif end == len(st.tokens):
                seq_ids.append(s.seq_id)
                num, token = self._verify(s.seq_id, st, drafts)
                token_ids.append(token)
                accepted.append(num)
            else:
                assert not drafts, f"seq {s.seq_id} has drafts but does not sample"
        for fork in plan.forks:
            parent = self.seqs[fork.parent_id]
            for cid in fork.child_ids:
                child = _SeqState(list(parent.tokens), list(parent.table), parent.num_computed,
                                  self.salt_of(cid))
                self.seqs[cid] = child
                seq_ids.append(cid)
                token_ids.append(self._sample(cid, child))
                accepted.append(0)
        return StepResult(plan.step_id, seq_ids, token_ids, None, None,
                          accepted if any(s.draft_token_ids for s in plan.scheduled) else [],
                          pooled_seq_ids=pooled_ids, pooled=pooled)

    def _verify(self, seq_id: int, st: _SeqState, drafts: list[int]) -> tuple[int, int]:
        """Greedy verification, from the pool (drafts in their slots): drafts are accepted
        while each is the model's next token; then the token after the accepted ones."""
        if not drafts:
            return 0, self._sample(seq_id, st)
        n = st.num_computed
        first = max(0, n - self.window) if self.window else 0
        seen = [self.gpu[st.table[p // self.bs]][p % self.bs] for p in range(first, n + len(drafts))]
        assert seen == st.tokens[first:n] + drafts, f"seq {seq_id}: the pool holds {seen}"
        history, num = st.tokens[:n], 0
        for draft in drafts:
            if self.model(st.salt, history, self.vocab, self.window) != draft:
                break
            history = history + [draft]
            num += 1
        self.verified.append((len(drafts), num))
        self.accepted_drafts.append(drafts[:num])
        return num, self.model(st.salt, history, self.vocab, self.window)

    def _sample(self, seq_id: int, st: _SeqState) -> int:
        n = st.num_computed
        assert all(0 <= b < len(self.gpu) for b in st.table), f"seq {seq_id}: table {st.table}"
        first = max(0, n - self.window) if self.window else 0
        seen = [self.gpu[st.table[p // self.bs]][p % self.bs] for p in range(first, n)]
        assert seen == st.tokens[first:n], (
            f"seq {seq_id}: the KV cache holds {seen} at positions {first}.. but its tokens are "
            f"{st.tokens[first:n]}")
        self.sampled_positions.append((seq_id, n))
        if self.script.get(seq_id):
            return self.script[seq_id].pop(0)
        return self.model(st.salt, st.tokens[:n], self.vocab, self.window)


def drive(sched, worker, *, now: float = 0.0, max_steps: int = 10_000, check=None,
          arrivals=None):
    """Run schedule/execute/update until nothing is unfinished; returns {request_id: {index:
    tokens}}, {request_id: {index: finish_reason}} and the list of plans."""
    tokens: dict[str, dict[int, list[int]]] = {}
    reasons: dict[str, dict[int, str]] = {}
    plans = []
    arrivals = dict(arrivals or {})
    for step in range(max_steps):
        for req in arrivals.pop(step, []):
            sched.add(req)
        if not sched.has_unfinished() and not arrivals:
            return tokens, reasons, plans
        plan = sched.schedule(now + step)
        plans.append(plan)
        if check is not None:
            check(sched, plan)
        result = worker.execute(plan)
        for out in sched.update(plan, result, now + step):
            tokens.setdefault(out.request_id, {}).setdefault(out.index, []).extend(
                out.new_token_ids)
            if out.finish_reason is not None:
                reasons.setdefault(out.request_id, {})[out.index] = out.finish_reason
    raise AssertionError(f"not done after {max_steps} steps: {sched.stats()}")


def make_scheduler(num_gpu_blocks: int, num_cpu_blocks: int = 0, *, eos=(), vocab: int = 1000,
                   salt_of=None, model=window_next_token, **config):
    """A scheduler over a real KVCacheManager plus a FakeWorker of the same pool sizes."""
    from pagedserve.pipeline.scheduler import Scheduler, SchedulerConfig

    config.setdefault("max_model_len", 256)
    config.setdefault("watermark", 0.0)
    cfg = SchedulerConfig(**config)
    sched = Scheduler.from_config(cfg, num_gpu_blocks, num_cpu_blocks, eos_token_ids=eos)
    worker = FakeWorker(num_gpu_blocks, num_cpu_blocks, cfg.block_size, vocab, salt_of,
                        window=cfg.sliding_window, model=model)
    return sched, worker


def step(sched, worker, now: float = 0.0):
    """One cycle; returns (plan, outputs)."""
    plan = sched.schedule(now)
    return plan, sched.update(plan, worker.execute(plan), now)


def brief(plan) -> dict:
    """The parts of a plan exact tests assert on, as plain tuples."""
    return {
        "new": [(n.seq_id, n.block_ids, n.num_computed_tokens, len(n.output_token_ids))
                for n in plan.new_seqs],
        "run": [(s.seq_id, s.num_tokens, s.new_block_ids) for s in plan.seq_steps()],
        "swap_out": plan.swap_out, "swap_in": plan.swap_in, "copy": plan.copy,
        "forks": [(f.parent_id, f.child_ids) for f in plan.forks],
        "finished": plan.finished_seq_ids,
    }


def plan_shape(**parts) -> dict:
    shape = {"new": [], "run": [], "swap_out": [], "swap_in": [], "copy": [], "forks": [],
             "finished": []}
    shape.update(parts)
    return shape
