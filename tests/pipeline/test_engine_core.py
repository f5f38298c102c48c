"""EngineCore: the real Scheduler, a WorkerCore over a tiny random Llama and the detokenizer in
one process, passing the processes' messages - and LLM(in_process=True) on top of it."""
import numpy as np
import pytest

from pagedserve.pipeline import messages
from pagedserve.pipeline.engine_core import EngineCore
from pagedserve.pipeline.config import EngineConfig
from pagedserve.pipeline.ingress.testing import make_tiny_tokenizer
from pagedserve.pipeline.llm import LLM
from pagedserve.pipeline.sampling_params import SamplingParams
from pagedserve.workers.testing import hf_greedy, make_tiny_llama


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=5, vocab_size=259)
    make_tiny_tokenizer().save_pretrained(path)
    return path


def engine_kwargs(tiny_dir, **extra):
    return dict(model=str(tiny_dir), dtype="float32", kv_cache_memory="8MiB", block_size=8,
                max_num_seqs=4, max_num_batched_tokens=32, swap_space=0.0, **extra)


def test_steps_give_transformers_greedy_tokens_and_their_text(tiny_dir):
    core = EngineCore.build(EngineConfig.from_kwargs(**engine_kwargs(tiny_dir)))
    tokenizer = core.detokenizer.tokenizer
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 40, 17, 3, 60)]  # 5 > max_num_seqs
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0)
    for i, prompt in enumerate(prompts):
        assert core.submit(messages.AddRequest(request_id=f"r{i}", prompt_token_ids=prompt,
                                               sampling=params, arrival_time=float(i))) == []
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    text = dict.fromkeys(tokens, "")
    finished, steps = set(), 0
    while core.has_unfinished():
        for msg in core.step(float(steps)):
            assert isinstance(msg, messages.DeltaBatch)
            for delta in msg.deltas:
                assert delta.token_offset == len(tokens[delta.request_id])
                tokens[delta.request_id] += delta.token_ids
                text[delta.request_id] += delta.text
                if delta.finish_reason is not None:
                    assert delta.finish_reason == "length"
                    finished.add(delta.request_id)
        steps += 1
    assert finished == set(tokens)
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == hf_greedy(tiny_dir, prompts, 10)
    for rid, ids in tokens.items():
        assert text[rid] == tokenizer.decode(ids, skip_special_tokens=True)
    assert steps > 10  # the prompts took chunks of at most 32 tokens, five requests took turns
    assert core.scheduler.kv.stats().gpu_blocks_used == 0


def run_greedy(core, prompts, max_tokens, abort_at=None):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    for i, prompt in enumerate(prompts):
        core.submit(messages.AddRequest(request_id=f"r{i}", prompt_token_ids=prompt,
                                        sampling=params, arrival_time=float(i)))
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    steps = 0
    while core.has_unfinished():
        out = core.step(float(steps))
        if steps == abort_at:
            out += core.abort("r0")
        for msg in out:
            for delta in msg.deltas:
                tokens[delta.request_id] += delta.token_ids
        steps += 1
    return tokens


@pytest.mark.parametrize("abort_at", [None, 12])
def test_the_in_process_engine_plans_steps_ahead_as_the_process_group_does(tiny_dir, abort_at):
    """The same StepLoop as the scheduler process: steady decodes are planned before the step
    in flight is applied, the worker decodes them from its own samples, and the tokens are
    those of the engine without overlap (an abort while a step ahead is in flight included)."""
    prompts = [[7, 8, 9, 10, 11], [40, 41, 42]]
    runs = {}
    for overlap in (False, True):
        core = EngineCore.build(EngineConfig.from_kwargs(
            **engine_kwargs(tiny_dir, async_scheduling=overlap)))
        runs[overlap] = run_greedy(core, prompts, 30, abort_at)
        assert (core.scheduler.num_steps_ahead > 20) is overlap, core.scheduler.num_steps_ahead
        assert core.scheduler.kv.stats().gpu_blocks_used == 0
    assert runs[True] == runs[False]
    if abort_at is None:
        assert list(runs[True].values()) == hf_greedy(tiny_dir, prompts, 30)
    else:
        assert 0 < len(runs[True]["r0"]) < 30 and len(runs[True]["r1"]) == 30


def test_a_request_that_can_never_run_is_rejected_by_the_scheduler(tiny_dir):
    core = EngineCore.build(EngineConfig.from_kwargs(**engine_kwargs(tiny_dir)))
    too_long = messages.AddRequest(request_id="x", prompt_token_ids=[1] * 10, arrival_time=0.0,
                                   sampling=SamplingParams(max_tokens=core.config.max_model_len))
    (reply,) = core.submit(too_long)
    assert isinstance(reply, messages.RequestRejected) and reply.status == 400
    assert "max_model_len" in reply.message and not core.has_unfinished()


def test_an_aborted_request_frees_its_blocks(tiny_dir):
    core = EngineCore.build(EngineConfig.from_kwargs(**engine_kwargs(tiny_dir)))
    core.submit(messages.AddRequest(request_id="a", prompt_token_ids=[5, 6, 7],
                                    sampling=SamplingParams(max_tokens=50, ignore_eos=True),
                                    arrival_time=0.0))
    core.step(0.0)
    assert core.scheduler.kv.stats().gpu_blocks_used > 0
    out = core.abort("a")
    assert [d.finish_reason for batch in out for d in batch.deltas] == ["abort"]
    assert core.scheduler.kv.stats().gpu_blocks_used == 0 and not core.has_unfinished()


def test_llm_in_process_generates_like_the_engine(tiny_dir):
    llm = LLM(in_process=True, **engine_kwargs(tiny_dir))
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0, n=2)
    prompts = [[7, 8, 9, 10], [100, 101]]
    outs = llm.generate(prompts, params)
    want = hf_greedy(tiny_dir, prompts, 6)
    assert [[o.token_ids for o in out.outputs] for out in outs] == [[w, w] for w in want]
    assert all(o.finish_reason == "length" for out in outs for o in out.outputs)
    assert llm.stats()["num_unfinished_requests"] == 0
    llm.close()


def test_a_windowed_model_holds_only_its_window_and_equals_transformers(tmp_path):
    """Mistral-style: every layer windowed (W=16, blocks of 8). Generating 4x the window, each
    sequence holds at most W/bs + 2 blocks at every step (the slid-out blocks go back to the
    pool, the kernels never read them), the tokens equal transformers', the pool ends empty."""
    from pagedserve.workers.testing import make_tiny_model
    window, block = 16, 8
    path = make_tiny_model(tmp_path / "mistral", "mistral", seed=3, vocab_size=259,
                           hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           sliding_window=window, max_position_embeddings=512,
                           bos_token_id=1, eos_token_id=2, pad_token_id=0)
    make_tiny_tokenizer().save_pretrained(path)
    core = EngineCore.build(EngineConfig.from_kwargs(**engine_kwargs(path)))
    assert core.scheduler.kv.stats().gpu_blocks_used == 0
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 256, n).tolist() for n in (20, 9)]
    params = SamplingParams(max_tokens=4 * window, ignore_eos=True, temperature=0.0)
    for i, prompt in enumerate(prompts):
        core.submit(messages.AddRequest(request_id=f"w{i}", prompt_token_ids=prompt,
                                        sampling=params, arrival_time=float(i)))
    tokens = {f"w{i}": [] for i in range(len(prompts))}
    peak, steps = 0, 0
    while core.has_unfinished():
        for msg in core.step(float(steps)):
            for delta in msg.deltas:
                tokens[delta.request_id] += delta.token_ids
        peak = max(peak, core.scheduler.kv.stats().gpu_blocks_used)
        steps += 1
    assert peak <= len(prompts) * (window // block + 2)
    assert [tokens[f"w{i}"] for i in range(len(prompts))] == hf_greedy(path, prompts, 4 * window)
    assert core.scheduler.kv.stats().gpu_blocks_used == 0
