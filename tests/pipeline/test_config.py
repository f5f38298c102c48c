"""Engine config: the CPU thread default and its flag, and the other flags."""
import os

import pytest

from pagedserve.pipeline.cli_args import build_arg_parser, config_from_args
from pagedserve.pipeline.config import ParallelArgs


def _cfg(*argv):
    return config_from_args(build_arg_parser().parse_args(list(argv)))


def test_cpu_threads_default_splits_the_cores_between_the_ranks(monkeypatch):
    def threads(*argv):
        return _cfg(*argv).parallel.threads_per_rank()

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert threads() == 8
    assert threads("--tensor-parallel-size", "2") == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert threads() == 2
    assert threads("-tp", "2") == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert threads() == 1


def test_cpu_threads_flag_wins_and_is_checked():
    parallel = _cfg("--cpu-threads", "2").parallel
    assert parallel.threads_per_rank() == 2
    with pytest.raises(ValueError, match="--cpu-threads must be >= 1, got 0"):
        _cfg("--cpu-threads", "0")
    with pytest.raises(ValueError, match="--cpu-threads"):
        ParallelArgs(cpu_threads=-3)


def test_kv_cache_dtype_flag():
    assert _cfg().cache.kv_cache_dtype == "auto"
    assert _cfg("--kv-cache-dtype", "fp8").cache.kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):   # argparse names the choices
        _cfg("--kv-cache-dtype", "int4")
    from pagedserve.pipeline.config import EngineConfig
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, float32, .*got 'q8'"):
        EngineConfig.from_kwargs(kv_cache_dtype="q8")


def test_quantization_flag():
    assert _cfg().model.quantization == "auto"
    assert _cfg("--quantization", "none").model.quantization == "none"
    assert _cfg("--quantization", "gguf").model.quantization == "gguf"
    assert _cfg("--quantization", "int8").model.quantization == "int8"
    assert _cfg("-q", "int8", "--dtype", "float32").model.quantization == "int8"
    with pytest.raises(SystemExit):   # argparse names the choices
        _cfg("--quantization", "int4")
    from pagedserve.pipeline.config import EngineConfig
    with pytest.raises(ValueError, match="--quantization must be one of auto, none, int8, gguf, "
                                         "awq, gptq, got 'int4'"):
        EngineConfig.from_kwargs(quantization="int4")
    with pytest.raises(ValueError, match="does not combine with --dtype bfloat16"):
        _cfg("--quantization", "int8", "--dtype", "bfloat16")


def test_offline_api_forwards_every_engine_argument_to_the_group(tmp_path):
    # LLM(...) starts the group with a command line: no engine argument may be dropped on the way
    from dataclasses import asdict

    from pagedserve.pipeline.config import EngineConfig
    from pagedserve.pipeline.engine_group import _config_to_argv
    given = dict(served_model_name="m", dtype="float32", quantization="int8", max_model_len=999,
                 seed=7, generation_config="vllm", chat_template="{{ messages }}",
                 block_size=32, kv_cache_memory="3MiB", gpu_memory_utilization=0.5,
                 swap_space=0.25, enable_prefix_caching=False, kv_cache_dtype="fp8",
                 tensor_parallel_size=2, device="cpu", cpu_threads=3, enforce_eager=True,
                 max_num_seqs=17,
                 max_num_batched_tokens=333, max_queued_requests=44,
                 enable_chunked_prefill=False, preemption_mode="swap",
                 scheduling_policy="priority", step_timeout=9.0, async_scheduling=False,
                 grammar_compile_timeout=4.5, max_restarts=5,
                 speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                     "prompt_lookup_max": 4},
                 restart_window=7.0, heartbeat_timeout=3.0,
                 pooler_config='{"pooling_type": "MEAN"}', enable_lora=True, max_loras=3,
                 max_lora_rank=32, max_cpu_loras=5, lora_modules=["a=/x", "b=/y"])
    # the KV tiers keep prefix-cached blocks: a second config turns them on with the cache
    tiers = dict(kv_offload_memory="2MiB", kv_offload_dir="/tiers", kv_offload_disk_size="1GiB")
    configs = [EngineConfig.from_kwargs(model="/some/dir", **given),
               EngineConfig.from_kwargs(model="/some/dir", **tiers)]
    sections = ("model", "cache", "parallel", "scheduling", "supervisor", "lora")
    for section in sections:
        defaults = asdict(getattr(EngineConfig(), section))
        assert all(any(asdict(getattr(c, section))[k] != v for c in configs)
                   for k, v in defaults.items() if k != "model"), \
            f"{section}: the test leaves a field at its default"
    for config in configs:
        config.ipc.ipc_dir = str(tmp_path / "ipc")
        argv = _config_to_argv(config, "/some/dir")
        argv.remove("--die-with-parent")   # the launcher's own flag (pipeline/launch.py)
        back = _cfg(*argv)
        for section in sections:
            assert asdict(getattr(back, section)) == asdict(getattr(config, section)), section


def test_grammar_compile_timeout_flag():
    assert _cfg().scheduling.grammar_compile_timeout == 30.0
    assert _cfg("--grammar-compile-timeout", "2.5").scheduling.grammar_compile_timeout == 2.5
    with pytest.raises(ValueError, match="--grammar-compile-timeout must be positive"):
        _cfg("--grammar-compile-timeout", "0")


def test_enforce_eager_flag():
    assert _cfg().parallel.enforce_eager is False
    assert _cfg("--enforce-eager").parallel.enforce_eager is True
    from pagedserve.pipeline.config import EngineConfig
    assert EngineConfig.from_kwargs(enforce_eager=True).parallel.enforce_eager is True


def test_ipc_dir_is_created_private_or_refused_when_others_can_enter(tmp_path):
    import os

    from pagedserve.pipeline.config import IpcArgs, prepare_ipc_dir
    fresh = tmp_path / "fresh"
    assert prepare_ipc_dir(str(fresh)) is True and (fresh.stat().st_mode & 0o777) == 0o700
    assert prepare_ipc_dir(str(fresh)) is False  # exists, private: used, not owned
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o755)
    with pytest.raises(ValueError, match=r"open to other users \(mode 0755\).*chmod 700"):
        prepare_ipc_dir(str(open_dir))
    a, b = IpcArgs(ipc_dir=str(tmp_path / "g")), IpcArgs(ipc_dir=str(tmp_path / "x" / "g"))
    assert a.tag != b.tag and a.tag.startswith("g-")  # same folder name, other groups
    # a random part no other user can derive, so none can plant a segment under the name
    nonce = a.shm_nonce
    assert len(nonce) == 32 and nonce != b.shm_nonce
    assert a.shm_segments(2) == [f"{a.tag}_{nonce}_bt", f"{a.tag}_{nonce}_swap0",
                                 f"{a.tag}_{nonce}_swap1"]
    assert a.rendezvous(3) == f"file://{tmp_path}/g/rendezvous-3"


def test_speculative_config_flag_takes_vllms_json_and_refuses_bad_settings():
    from pagedserve.pipeline.config import EngineConfig
    from pagedserve.pipeline.scheduler import SchedulerConfig
    from pagedserve.pipeline.speculative_config import SpeculativeConfig
    cfg = _cfg("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, '
                                       '"prompt_lookup_max": 3}')
    assert cfg.scheduling.speculative_config == {"method": "ngram", "num_speculative_tokens": 4,
                                                 "prompt_lookup_max": 3}
    # as in vLLM, a missing bound takes the other's value, both missing 5
    assert SpeculativeConfig.parse(cfg.scheduling.speculative_config) == SpeculativeConfig(
        "ngram", 4, 3, 3)
    assert SpeculativeConfig.parse('{"num_speculative_tokens": 2}') == SpeculativeConfig(
        "ngram", 2, 5, 5)
    assert SpeculativeConfig.parse(None) is None and _cfg().scheduling.speculative_config is None
    with pytest.raises(SystemExit):   # argparse: not JSON
        _cfg("--speculative-config", "ngram")
    bad = [({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of ngram"),
           ({"method": "ngram"}, "num_speculative_tokens is required"),
           ({"num_speculative_tokens": 0}, "num_speculative_tokens must be in 1..32"),
           ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            r"need 1 <= prompt_lookup_min \(4\) <= prompt_lookup_max \(2\)"),
           ({"num_speculative_tokens": 2, "draft_model": "x"}, "unknown key.*draft_model"),
           ({"num_speculative_tokens": "4"}, "num_speculative_tokens must be an integer")]
    for value, message in bad:
        with pytest.raises(ValueError, match="--speculative-config: " + message):
            EngineConfig.from_kwargs(speculative_config=value)
    on = EngineConfig.from_kwargs(model="m", max_model_len=64, speculative_config={
        "num_speculative_tokens": 2, "disable_by_batch_size": 8})
    assert SchedulerConfig.from_engine(on).speculative == SpeculativeConfig("ngram", 2, 5, 5, 8)
