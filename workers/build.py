"""Building one worker rank from the engine configuration: its device and dtype, the
torch.distributed group, the model shard, the KV cache and swap pool, and (rank 0) the sampler.
The worker process and the in-process EngineCore build their WorkerCore here."""
from __future__ import annotations

import os

from pagedserve.pipeline.config import EngineConfig

DEFAULT_CPU_KV_BYTES = 2 * 1024**3


def pick_device(cfg: EngineConfig, rank: int):
    import torch
    want = cfg.parallel.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for but torch sees no CUDA device")
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def resolve_dtype(name: str, device):
    """The torch dtype of `--dtype name` on `device`. `auto` is bfloat16 where the device
    multiplies it natively (CUDA with bf16 support; CPUs with AVX512-BF16 or AMX-BF16 whose oneDNN
    packs bf16), float16 on older CUDA, and float32 on other CPUs: there a bf16 matmul is
    emulated (AVX2 EPYC, [256 x 576] @ [576 x 1536]: bf16 16 GFLOP/s, fp32 129 GFLOP/s)."""
    import torch
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    from pagedserve.kernels import native as native_kernels
    from pagedserve.workers.models.layers import bf16_prepack_supported
    native = (bf16_prepack_supported()
              and bool(native_kernels.cpu_flags() & {"avx512_bf16", "amx_bf16"}))
    return torch.bfloat16 if native else torch.float32


def build_core(cfg: EngineConfig, rank: int, *, shared_swap: bool = True):
    """Model shard, KV cache, swap pool and (rank 0) sampler for this rank: (core, device
    blocks, host blocks). `shared_swap`: the host swap pool lives in shared memory named after
    the group, so that it outlives a worker restart (in one process a private pool serves)."""
    import torch
    from pagedserve.workers.distributed import init_distributed
    from pagedserve.workers.kv_cache import block_bytes, device_budget_bytes, num_blocks_for_bytes
    from pagedserve.kernels import native_decode_attention
    from pagedserve.kernels.kv_format import resolve_kv_cache_dtype
    from pagedserve.workers.loader import load_config as load_model_config, weights_quantization
    from pagedserve.workers.model_runner import ModelRunner
    from pagedserve.workers.sampler import Sampler
    from pagedserve.workers.core import WorkerCore
    from pagedserve.workers.lora.setup import LoRASetup

    tp = cfg.parallel.tensor_parallel_size
    device = pick_device(cfg, rank)
    adapt_threads = device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ
    if adapt_threads:  # else $OMP_NUM_THREADS sets torch's threads and the kernel follows them
        threads = cfg.parallel.threads_per_rank(len(cfg.cluster.local_ranks(tp)))
        torch.set_num_threads(threads)
        native_decode_attention.set_threads(threads)
    dtype = resolve_dtype(cfg.model.dtype, device)
    quantization = weights_quantization(cfg.model.quantization, cfg.model.model)
    if cfg.model.dtype == "auto" and device.type == "cpu" and quantization != "none":
        dtype = torch.float32   # quantized linears take and give fp32 on CPU
                                # (kernels/native_linear_q8.py, native_linear_gguf.py)
    cache_dtype = resolve_kv_cache_dtype(cfg.cache.kv_cache_dtype, dtype)
    if cfg.cache.kv_cache_dtype == "auto" and dtype != resolve_dtype(cfg.model.dtype, device):
        # fp32 only for the quantized linears: the cache keeps what --dtype auto would compute in
        cache_dtype = resolve_dtype(cfg.model.dtype, device)
    model_config = load_model_config(cfg.model.model)
    init_distributed(rank, tp, cfg.ipc.dist_init_addr, device)
    torch.manual_seed(cfg.model.seed)
    # Weights first, so that on CUDA the budget is a fraction of what they leave free.
    runner_blocks = None
    budget = cfg.cache.kv_cache_memory
    if budget is None and device.type == "cpu":
        budget = DEFAULT_CPU_KV_BYTES
    if budget is not None:
        runner_blocks = num_blocks_for_bytes(model_config, cfg.cache.block_size, cache_dtype,
                                             budget, tp)
    else:
        probe = ModelRunner(model_config, cfg.model.model, dtype, device, cfg.cache.block_size, 1,
                            rank, tp, cache_dtype, cuda_graph_batch=0,
                            quantization=quantization)
        free = device_budget_bytes(device, memory_utilization=cfg.cache.gpu_memory_utilization)
        runner_blocks = num_blocks_for_bytes(model_config, cfg.cache.block_size, cache_dtype,
                                             free, tp)
        del probe
        torch.cuda.empty_cache()
    runner = ModelRunner(model_config, cfg.model.model, dtype, device, cfg.cache.block_size,
                         runner_blocks, rank, tp, cache_dtype,
                         cuda_graph_batch=0 if cfg.parallel.enforce_eager
                         else cfg.scheduling.max_num_seqs, quantization=quantization,
                         cpu_replay=not cfg.parallel.enforce_eager,
                         pooler=cfg.model_info.pooler(), lora=LoRASetup.from_args(cfg.lora))
    per_block = block_bytes(model_config, cfg.cache.block_size, cache_dtype, tp)
    num_cpu_blocks = int(cfg.cache.swap_space * 1024**3) // per_block
    if model_config.is_encoder:
        num_cpu_blocks = 0  # an encoder's input runs within one step: nothing is ever swapped
    core = WorkerCore(runner, Sampler() if rank == 0 else None, num_cpu_blocks,
                      swap_shm_name=cfg.ipc.swap_segment(rank) if shared_swap else None)
    if cfg.cache.kv_offload_memory or cfg.cache.kv_offload_dir:
        from pagedserve.workers.kv_tiers import build_tier_io
        core.tiers = build_tier_io(cfg, runner.kv_cache, per_block, model_config, rank)
    if cfg.env.step_trace and rank == 0:
        from pagedserve.workers.step_trace import StepProfiler
        core.profiler = StepProfiler(runner.model, runner.cpu_replay)
    return core, runner_blocks, num_cpu_blocks
