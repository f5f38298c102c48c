"""The scheduler's part of LoRA: a request's adapter rides on its NewSeqs, no step uses more
adapters than --max-loras (the others wait their turn), the prefix cache is keyed by adapter,
and bad input is refused naming the cause."""
import pytest

from pagedserve.pipeline.lora_request import LoRARequest
from pagedserve.pipeline.messages import StepResult
from pagedserve.pipeline.scheduler import RequestRejected, Scheduler
from pagedserve.pipeline.scheduler.config import SchedulerConfig
from pagedserve.pipeline.scheduler.sequence import Request
from pagedserve.pipeline.sampling_params import SamplingParams

PROMPT = list(range(1, 33))   # two full blocks of 16


def _lora(i: int) -> LoRARequest:
    return LoRARequest(lora_name=f"a{i}", lora_int_id=i, lora_path=f"/adapters/a{i}")


def _scheduler(max_loras: int) -> Scheduler:
    return Scheduler.from_config(SchedulerConfig(max_model_len=256, max_loras=max_loras),
                                 num_gpu_blocks=64)


def _add(s: Scheduler, rid: str, lora: LoRARequest | None, salt: str | None = None) -> None:
    s.add(Request(rid, list(PROMPT), SamplingParams(max_tokens=4, temperature=0.0),
                  cache_salt=salt, lora=lora))


def _step(s: Scheduler, now: float):
    plan = s.schedule(now)
    ids = [seq.seq_id for seq in plan.seq_steps()]
    s.update(plan, StepResult(plan.step_id, ids, [7] * len(ids), None, None), now)
    return plan


def test_no_step_uses_more_adapters_than_max_loras_and_all_finish():
    s = _scheduler(max_loras=2)
    for i, lora in enumerate([_lora(1), _lora(2), _lora(3), None, _lora(1)]):
        _add(s, f"r{i}", lora)
    seen: dict[str, int] = {}
    for now in range(40):
        plan = _step(s, float(now))
        running = {seq.request.lora.lora_int_id for seq in s.seqs.values()
                   if not seq.is_finished and seq.request.lora is not None
                   and seq.status.name == "RUNNING"}
        assert len(running) <= 2
        for new in plan.new_seqs:
            seen[s.seqs[new.seq_id].request.request_id] = new.lora.lora_int_id if new.lora else 0
        if now == 0:
            assert s.queues.lora_stats(2) == {"lora_running": ["a1", "a2"],
                                               "lora_waiting": ["a1", "a3"], "max_lora": 2}
        if not s.has_unfinished():
            break
    assert not s.has_unfinished()
    assert seen == {"r0": 1, "r1": 2, "r2": 3, "r3": 0, "r4": 1}


def test_the_prefix_cache_is_keyed_by_adapter():
    s = _scheduler(max_loras=4)
    _add(s, "base", None)
    while s.has_unfinished():
        _step(s, 0.0)
    for rid, lora in (("again", None), ("adapted", _lora(1))):
        _add(s, rid, lora)
        (new,) = _step(s, 1.0).new_seqs
        assert new.num_computed_tokens == (16 if lora is None else 0), rid   # not an adapter's
        while s.has_unfinished():
            _step(s, 2.0)


def test_bad_lora_input_is_refused_naming_the_cause():
    off = _scheduler(max_loras=0)
    with pytest.raises(RequestRejected, match="LoRA is disabled"):
        _add(off, "r", _lora(1))
    with pytest.raises(RequestRejected, match="cache_salt may not start"):
        _add(off, "s", None, salt="\x00lora\x001\x00")
