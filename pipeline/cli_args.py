"""The command line of `python -m pagedserve.pipeline.launch` (vLLM's flag names) and the
EngineConfig it gives (pipeline/config.py holds the sections it fills)."""
from __future__ import annotations

import argparse
import json

from pagedserve import envs
from pagedserve.envs import Environment
from pagedserve.pipeline.config import (FIELD_OWNER, KV_CACHE_DTYPE_NAMES, QUANTIZATIONS,
                                        EngineConfig, parse_bytes)
from pagedserve.pipeline.lora_config import add_lora_args
from pagedserve.private_files import read_private


def _bool_flag(parser: argparse.ArgumentParser, name: str, default: bool, help: str) -> None:
    parser.add_argument(f"--{name}", dest=name.replace("-", "_"), action=argparse.BooleanOptionalAction,
                        default=default, help=help)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedserve", description="pagedserve: paged-KV LLM serving")
    d = EngineConfig()
    p.add_argument("--model", default=d.model.model,
                   help="HF directory, .gguf file, or a built-in name (workers/builtin_models.py)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--dtype", default=d.model.dtype)
    p.add_argument("--quantization", "-q", default=d.model.quantization, choices=QUANTIZATIONS,
                   help="auto (default): a GGUF, AWQ or GPTQ checkpoint's weights stay in their "
                        "format (gguf, awq, gptq name it explicitly); none: dequantized at load "
                        "to --dtype; int8: weights and activations in int8 blocks of 32 "
                        "(llama.cpp's Q8_0 scheme), CPU workers only")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--generation-config", default="auto", help="auto: the model's "
                   "generation_config.json fills unset sampling fields; vllm: no; or a directory")
    p.add_argument("--chat-template", default=None, help="a file or an inline Jinja template")
    p.add_argument("--pooler-config", default=None, help="how /v1/embeddings pools, as vLLM's "
                   "JSON: {\"pooling_type\": \"LAST\" | \"MEAN\" | \"CLS\", \"normalize\": "
                   "true}; default: the model's sentence-transformers config, else LAST "
                   "(decoders) or CLS (encoders), normalized")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=d.cache.block_size)
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help="KV cache bytes per worker rank (e.g. 2GiB); default: 2GiB on CPU, "
                        "--gpu-memory-utilization on CUDA")
    p.add_argument("--gpu-memory-utilization", type=float, default=d.cache.gpu_memory_utilization)
    p.add_argument("--swap-space", type=float, default=d.cache.swap_space, help="GiB of host swap pool")
    p.add_argument("--kv-cache-dtype", default=d.cache.kv_cache_dtype, choices=KV_CACHE_DTYPE_NAMES,
                   help="KV cache storage: auto (the model dtype), bfloat16, float16, float32, "
                        "fp8 (= fp8_e4m3) or fp8_e5m2; fp8 halves bf16's cache bytes and decode "
                        "attention reads, unscaled like vLLM without calibration")
    _bool_flag(p, "enable-prefix-caching", d.cache.enable_prefix_caching, "share cached prompt prefixes")
    p.add_argument("--kv-offload-memory", type=parse_bytes, default=0,
                   help="host-memory KV tier per worker rank (e.g. 4GiB): prefix-cached blocks "
                        "are copied there and loaded back instead of recomputed; 0: none")
    p.add_argument("--kv-offload-dir", default=None,
                   help="disk KV tier: a private (0700) directory of block files that survives "
                        "restarts and is shared by the replicas on this host")
    p.add_argument("--kv-offload-disk-size", type=parse_bytes, default=d.cache.kv_offload_disk_size,
                   help="bytes the disk KV tier may fill (default 8GiB); least recently used "
                        "blocks are deleted past it")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="compute threads per CPU worker rank (default: the usable cores, split "
                        "between the ranks, at least 1; $OMP_NUM_THREADS overrides)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run every step eagerly (default: on CUDA, decode-only steps of up to "
                        "--max-num-seqs sequences replay captured CUDA graphs; on CPU, steps of "
                        "up to 32 tokens replay their recorded native kernel calls)")
    p.add_argument("--nnodes", type=int, default=1, help="hosts the tensor-parallel ranks span")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this host's place: 0 runs the whole group, others only their ranks")
    p.add_argument("--master-addr", default="", help="node 0's address: the only one it binds")
    p.add_argument("--master-port", type=int, default=d.cluster.master_port,
                   help="rendezvous port; the plans go over the next one")
    p.add_argument("--cluster-secret-file", default="",
                   help="a secret every node holds (mode 0600): authenticates the tcp sockets")
    p.add_argument("--max-num-seqs", type=int, default=d.scheduling.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.scheduling.max_num_batched_tokens)
    p.add_argument("--max-queued-requests", type=int, default=d.scheduling.max_queued_requests)
    _bool_flag(p, "enable-chunked-prefill", True, "split long prompts into chunks")
    p.add_argument("--preemption-mode", default="auto", choices=["swap", "recompute", "auto"])
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    p.add_argument("--speculative-config", type=_json_object, default=None,
                   help='n-gram speculative decoding, vLLM\'s JSON: {"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 3, '
                        '"prompt_lookup_min": 2}; optional "disable_by_batch_size"')
    _bool_flag(p, "async-scheduling", True, "plan the next step of steady decodes while the "
               "workers compute this one (one worker rank; outputs unchanged)")
    p.add_argument("--step-timeout", type=float, default=d.scheduling.step_timeout,
                   help="seconds a step may take before the worker group counts as hung")
    p.add_argument("--grammar-compile-timeout", type=float,
                   default=d.scheduling.grammar_compile_timeout,
                   help="seconds one structured-output grammar may take to compile (in its own "
                        "bounded process, killed past it: the request gets a 400)")
    p.add_argument("--max-restarts", type=int, default=d.supervisor.max_restarts,
                   help="restarts of one role within --restart-window before giving up")
    p.add_argument("--restart-window", type=float, default=d.supervisor.restart_window)
    p.add_argument("--heartbeat-timeout", type=float, default=d.supervisor.heartbeat_timeout)
    p.add_argument("--host", default=d.server.host)
    p.add_argument("--port", type=int, default=d.server.port)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' (default: $PAGEDSERVE_API_KEY); "
                        "a command line shows the key to every local user: prefer --api-key-file")
    p.add_argument("--api-key-file", default=None,
                   help="a file of ours, mode 0600, holding the API key")
    p.add_argument("--replica-secret-file", default=None, help=argparse.SUPPRESS)  # the router's
    _bool_flag(p, "http", True, "start the OpenAI-compatible HTTP ingress")
    p.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                   help="read tool calls from chat output in this format (tool_choice auto); "
                        "default: the one the chat template calls for, if any")
    p.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                   help="send a model's <think>...</think> as reasoning_content")
    p.add_argument("--ipc-dir", default="", help="folder for ipc:// sockets (default: a temp dir)")
    add_lora_args(p, d.lora)
    for name in ("frontend", "output", "plan", "events", "detok", "control"):
        p.add_argument(f"--{name}-addr", default="", help=argparse.SUPPRESS)
    return p


def config_from_args(ns: argparse.Namespace, env: Environment | None = None) -> EngineConfig:
    """The command line plus the environment (read here, once, unless given)."""
    kwargs = {k: v for k, v in vars(ns).items() if k in FIELD_OWNER}
    cfg = EngineConfig.from_kwargs(**kwargs)
    cfg.env = envs.from_environ() if env is None else env
    if getattr(ns, "api_key_file", None):
        if cfg.server.api_key is not None:
            raise ValueError("give --api-key or --api-key-file, not both")
        cfg.server.api_key = _one_line(ns.api_key_file, "--api-key-file")
    if getattr(ns, "replica_secret_file", None):
        cfg.server.replica_secret = _one_line(ns.replica_secret_file, "--replica-secret-file")
    if cfg.server.api_key is None:
        cfg.server.api_key = cfg.env.api_key
    cfg.ipc.fill_defaults()
    return cfg


def _one_line(path: str, flag: str) -> str:
    """A secret file's text without surrounding whitespace; refused when empty."""
    secret = read_private(path, flag).strip()
    if not secret:
        raise ValueError(f"{flag} {path} is empty")
    return secret
