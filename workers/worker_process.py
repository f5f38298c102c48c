"""Worker role, one per tensor-parallel rank: `python -m pagedserve.workers.worker_process --rank R ...`.

Thin glue around WorkerCore: connect a DEALER to the scheduler's worker ROUTER, join the
torch.distributed group, load the model shard and KV cache, report WorkerReady (with the block
counts this rank can hold), then execute every StepPlan; rank 0 replies with the StepResult.
"""
from __future__ import annotations

import os
import sys

import zmq

from pagedserve.pipeline import ipc, messages
from pagedserve.pipeline.config import EngineConfig
from pagedserve.pipeline.faults import FaultInjector
from pagedserve.pipeline.procutil import die_with_parent, load_config, role_arg_parser, setup_logging

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


def build_core(cfg: EngineConfig, rank: int):
    """Model shard, KV cache, swap pool and (rank 0) sampler for this rank."""
    import torch
    from pagedserve.workers.distributed import init_distributed
    from pagedserve.workers.kv_cache import block_bytes, device_budget_bytes, num_blocks_for_bytes
    from pagedserve.kernels import native_decode_attention
    from pagedserve.kernels.kv_format import resolve_kv_cache_dtype
    from pagedserve.workers.loader import load_config as load_model_config
    from pagedserve.workers.model_runner import ModelRunner
    from pagedserve.workers.sampler import Sampler
    from pagedserve.workers.worker_core import WorkerCore

    tp = cfg.parallel.tensor_parallel_size
    device = pick_device(cfg, rank)
    adapt_threads = device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ
    if adapt_threads:  # else $OMP_NUM_THREADS sets torch's threads and the kernel follows them
        torch.set_num_threads(cfg.parallel.threads_per_rank())
        native_decode_attention.set_threads(cfg.parallel.threads_per_rank())
    dtype = resolve_dtype(cfg.model.dtype, device)
    if cfg.model.quantization == "int8" and cfg.model.dtype == "auto":
        dtype = torch.float32   # int8 linears take and give fp32 (kernels/native_linear_q8.py)
    cache_dtype = resolve_kv_cache_dtype(cfg.cache.kv_cache_dtype, dtype)
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
                            quantization=cfg.model.quantization)
        free = device_budget_bytes(device, memory_utilization=cfg.cache.gpu_memory_utilization)
        runner_blocks = num_blocks_for_bytes(model_config, cfg.cache.block_size, cache_dtype,
                                             free, tp)
        del probe
        torch.cuda.empty_cache()
    runner = ModelRunner(model_config, cfg.model.model, dtype, device, cfg.cache.block_size,
                         runner_blocks, rank, tp, cache_dtype,
                         cuda_graph_batch=0 if cfg.parallel.enforce_eager
                         else cfg.scheduling.max_num_seqs, quantization=cfg.model.quantization)
    per_block = block_bytes(model_config, cfg.cache.block_size, cache_dtype, tp)
    num_cpu_blocks = int(cfg.cache.swap_space * 1024**3) // per_block
    tag = os.path.basename(cfg.ipc.ipc_dir) or f"pagedserve-{os.getppid()}"
    core = WorkerCore(runner, Sampler() if rank == 0 else None, num_cpu_blocks,
                      swap_shm_name=f"{tag}_swap{rank}")
    return core, runner_blocks, num_cpu_blocks


def main() -> int:
    ns = role_arg_parser("pagedserve worker").parse_args()
    cfg = load_config(ns)
    rank = ns.rank
    log = setup_logging(f"worker{rank}")
    die_with_parent()
    ctx = zmq.Context()
    sched = ipc.make_socket(ctx, zmq.DEALER, cfg.ipc.plan_addr, bind=False,
                            identity=f"worker{rank}".encode())
    control = ipc.make_socket(ctx, zmq.PUSH, cfg.ipc.control_addr, bind=False)
    step_id = -1
    faults = FaultInjector.from_env(f"worker{rank}")
    applied_token = None
    try:
        core, num_blocks, num_cpu_blocks = build_core(cfg, rank)
        # Unsolicited: the scheduler answers with Reset(token) to make us part of its epoch.
        ipc.send(sched, messages.WorkerReady(rank, os.getpid(), num_blocks, num_cpu_blocks))
        ipc.send(control, messages.ProcessReady("worker", rank, os.getpid(),
                                                f"{num_blocks} KV blocks"))
        log.info("ready: %d device blocks, %d host blocks", num_blocks, num_cpu_blocks)
        faults.started()
        while True:
            msg = ipc.recv(sched)
            if isinstance(msg, messages.StepPlan):
                step_id = msg.step_id
                faults.on_message(step=step_id)
                result = core.execute(msg)
                if result is not None:
                    ipc.send(sched, result)
            elif isinstance(msg, messages.Reset):
                if msg.token != applied_token:  # resent until answered: apply once
                    core.reset()
                    applied_token = msg.token
                ipc.send(sched, messages.WorkerReady(rank, os.getpid(), num_blocks,
                                                     num_cpu_blocks, msg.token))
            elif isinstance(msg, messages.Shutdown):
                log.info("stop (%s)", msg.reason or "shutdown")
                return 0
    except KeyboardInterrupt:
        return 0
    except Exception as exc:
        log.exception("fatal at step %d: %s", step_id, exc)
        text = f"{type(exc).__name__}: {exc}"
        for sock, msg in ((sched, messages.WorkerFailed(rank, step_id, text)),
                          (control, messages.ProcessFatal("worker", rank, os.getpid(), text))):
            try:
                ipc.send(sock, msg, flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        return 1
    finally:
        from pagedserve.workers.distributed import destroy_distributed
        destroy_distributed()
        sched.close(linger=500)
        control.close(linger=500)
        ctx.term()


if __name__ == "__main__":
    sys.exit(main())
