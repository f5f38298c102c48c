"""The scheduler with KV tiers below a tiny device pool, against a fake worker group whose
pool slots hold token ids: multi-turn conversations give the same tokens with the tiers on
and off, compute fewer prefill tokens with them, and a failed disk load is recomputed."""
import msgspec

from pagedserve.kvmanager.tiers import DiskTier, HostTier, KVTiers
from pagedserve.kv_tier_files import namespace_digest
from pagedserve.pipeline.sampling_params import SamplingParams
from pagedserve.pipeline.scheduler.sequence import Request

from sched_fakes import FakeWorker, expected_tokens, make_scheduler

BS = 4


class TieredFakeWorker(FakeWorker):
    """Applies a plan's TierOps as workers/kv_tiers.py does (stores read first, loads, then
    the stored copies written); a load of a hash in `fail_loads` fails and is recomputed."""

    def __init__(self, *args, fail_loads=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.host: dict[int, list] = {}
        self.disk: dict[bytes, list] = {}
        self.fail_loads = fail_loads
        self.failed: list[bytes] = []
        self.computed = 0  # prompt tokens computed (scheduled, recomputed ones included)

    def execute(self, plan):
        ops, unfilled = plan.tiers, set()
        if ops is not None:
            staged = [list(self.gpu[b]) for b in ops.store_blocks]
            for slot, block in ops.load_host:
                self.gpu[block] = list(self.host[slot])
            for block_hash, block in ops.load_disk:
                if block_hash in self.fail_loads or block_hash not in self.disk:
                    self.gpu[block] = [None] * self.bs
                    unfilled.add(block)
                    self.failed.append(block_hash)
                else:
                    self.gpu[block] = list(self.disk[block_hash])
            for i, data in enumerate(staged):
                if ops.store_slots[i] >= 0:
                    self.host[ops.store_slots[i]] = data
                if ops.store_hashes and ops.store_hashes[i]:
                    self.disk[ops.store_hashes[i]] = data
            for block_hash in ops.delete:
                self.disk.pop(block_hash, None)
        if unfilled:
            plan = self._recompute(plan, unfilled)
        self.computed += sum(s.num_tokens for s in plan.scheduled)
        result = super().execute(plan)
        result.tier_failed, self.failed = self.failed, []
        return result

    def _recompute(self, plan, unfilled):
        """As WorkerCore._move_tiers: a new sequence counting an unfilled block as computed
        computes again from that block on."""
        extra, new_seqs = {}, []
        for new in plan.new_seqs:
            computed = new.block_ids[:new.num_computed_tokens // self.bs]
            first = next((i for i, b in enumerate(computed) if b in unfilled), None)
            if first is not None:
                extra[new.seq_id] = new.num_computed_tokens - first * self.bs
                new = msgspec.structs.replace(new, num_computed_tokens=first * self.bs)
            new_seqs.append(new)
        scheduled = [msgspec.structs.replace(s, num_tokens=s.num_tokens + extra.get(s.seq_id, 0))
                     for s in plan.scheduled]
        return msgspec.structs.replace(plan, new_seqs=new_seqs, scheduled=scheduled)


def _conversations(num: int, turns: int, seed: int = 0):
    """Per conversation, its prompts turn by turn: each resends all before it plus new tokens."""
    import random
    rng = random.Random(seed)
    convs = []
    for c in range(num):
        history, prompts = [], []
        for _t in range(turns):
            history = history + [rng.randrange(1, 900) for _ in range(rng.randrange(6, 14))]
            prompts.append(list(history))
            history = history + expected_tokens(history, 3, 1000)  # the reply, resent next turn
        convs.append(prompts)
    return convs


def _run(tiers, num_gpu=24, fail_loads=(), tmp_path=None):
    sched, plain = make_scheduler(num_gpu, block_size=BS, max_model_len=128,
                                  max_num_batched_tokens=64, max_num_seqs=4)
    worker = TieredFakeWorker(num_gpu, 0, BS, fail_loads=fail_loads)
    if tiers is not None:
        sched.kv.attach_tiers(tiers)
    outputs, step = {}, 0
    params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0)
    convs = _conversations(6, 4)
    for turn in range(4):             # every conversation's turn, then the next turn
        for c, prompts in enumerate(convs):
            sched.add(Request(f"c{c}t{turn}", prompts[turn], params, float(step)))
        while sched.has_unfinished():
            plan = sched.schedule(float(step))
            for out in sched.update(plan, worker.execute(plan), float(step)):
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            step += 1
    for c, prompts in enumerate(convs):
        for turn, prompt in enumerate(prompts):
            assert outputs[f"c{c}t{turn}"] == expected_tokens(prompt, 3, 1000)
    return worker, sched


def test_multi_turn_gives_the_same_tokens_and_computes_less_with_a_host_tier():
    off, _ = _run(None)
    on, sched = _run(KVTiers(HostTier(64), None, block_bytes=1))
    stats = sched.kv.tiers.stats()
    assert stats["kv_host_loads"] > 0 and stats["kv_host_stores"] > 0
    assert on.computed < off.computed


def test_disk_tier_and_a_failed_load_recomputed_in_the_same_step(tmp_path):
    ns = namespace_digest(test=1)
    off, _ = _run(None)
    on, sched = _run(KVTiers(None, DiskTier(str(tmp_path), ns, 1000), block_bytes=1))
    assert sched.kv.tiers.stats()["kv_disk_loads"] > 0 and on.computed < off.computed
    # every load fails: same tokens, each failure reported and the block forgotten
    bad, sched = _run(KVTiers(None, DiskTier(str(tmp_path / "b"), ns, 1000), block_bytes=1),
                      fail_loads=_AllHashes())
    stats = sched.kv.tiers.stats()
    assert stats["kv_disk_loads"] > 0 and stats["kv_disk_failures"] == stats["kv_disk_loads"]
    assert bad.computed > on.computed


class _AllHashes:
    def __contains__(self, item):
        return True
