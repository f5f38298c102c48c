"""A whole engine group (launcher, scheduler, workers, detokenizer) as a subprocess of the
offline API, with the socket addresses its clients connect to."""
from __future__ import annotations

import atexit
import json
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from pagedserve import envs
from pagedserve.lifecycle import stop_process_group
from pagedserve.pipeline.config import EngineConfig
from pagedserve.pipeline.lora_config import lora_argv


class EngineGroup:
    """A launcher subprocess running one engine group, with its socket addresses."""

    def __init__(self, **engine_kwargs: Any):
        from pagedserve.pipeline.model_resolution import resolve_model
        from pagedserve.pipeline.tokenizer import load_tokenizer

        engine_kwargs.setdefault("http", False)
        config = EngineConfig.from_kwargs(**engine_kwargs)
        resolve_model(config)  # here, so that the tokenizer is at hand; the launcher reuses it
        self.config = config   # (LoRA: what LLM.generate checks a lora_request against)
        self.model_dir = config.model_info.model_dir
        self.tokenizer = load_tokenizer(config.model_info.tokenizer_dir,
                                        chat_template=config.model_info.chat_template)
        self.start_timeout = envs.current().start_timeout
        self.ipc_dir = tempfile.mkdtemp(prefix="pagedserve-")
        config.ipc.ipc_dir = self.ipc_dir
        config.ipc.fill_defaults()
        self.frontend_addr = config.ipc.frontend_addr
        self.output_addr = config.ipc.output_addr
        argv = _config_to_argv(config, str(self.model_dir))
        self.proc = subprocess.Popen([sys.executable, "-m", "pagedserve.pipeline.launch", *argv],
                                     env=envs.child_environ(), start_new_session=True)
        atexit.register(self.stop)

    def wait_ready(self, client_health) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the engine group exited with code {self.proc.returncode} "
                                   "during start-up (its log is above)")
            if client_health():
                return
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"the engine group was not ready within {self.start_timeout:.0f}s")

    def stop(self, timeout: float = 120.0) -> int | None:
        if self.proc.poll() is None:
            stop_process_group(self.proc, timeout)
        atexit.unregister(self.stop)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)  # ours: made in __init__
        return self.proc.returncode


def _config_to_argv(config: EngineConfig, model_dir: str) -> list[str]:
    m, c, p, s = config.model, config.cache, config.parallel, config.scheduling
    argv = ["--model", model_dir, "--dtype", m.dtype, "--quantization", m.quantization,
            "--seed", str(m.seed),
            "--block-size", str(c.block_size), "--swap-space", str(c.swap_space),
            "--kv-cache-dtype", c.kv_cache_dtype,
            "--gpu-memory-utilization", str(c.gpu_memory_utilization),
            "--tensor-parallel-size", str(p.tensor_parallel_size), "--device", p.device,
            "--max-num-seqs", str(s.max_num_seqs),
            "--max-num-batched-tokens", str(s.max_num_batched_tokens),
            "--max-queued-requests", str(s.max_queued_requests),
            "--preemption-mode", s.preemption_mode, "--scheduling-policy", s.scheduling_policy,
            "--step-timeout", str(s.step_timeout),
            "--grammar-compile-timeout", str(s.grammar_compile_timeout),
            "--max-restarts", str(config.supervisor.max_restarts),
            "--restart-window", str(config.supervisor.restart_window),
            "--heartbeat-timeout", str(config.supervisor.heartbeat_timeout),
            "--ipc-dir", config.ipc.ipc_dir, "--no-http", "--die-with-parent"]
    if m.served_model_name:
        argv += ["--served-model-name", m.served_model_name]
    if m.max_model_len:
        argv += ["--max-model-len", str(m.max_model_len)]
    argv += ["--generation-config", m.generation_config]
    if m.chat_template is not None:
        argv += ["--chat-template", m.chat_template]
    if m.pooler_config is not None:
        argv += ["--pooler-config", m.pooler_config]
    if c.kv_cache_memory:
        argv += ["--kv-cache-memory", str(c.kv_cache_memory)]
    if c.kv_offload_memory:
        argv += ["--kv-offload-memory", str(c.kv_offload_memory)]
    if c.kv_offload_dir:
        argv += ["--kv-offload-dir", c.kv_offload_dir,
                 "--kv-offload-disk-size", str(c.kv_offload_disk_size)]
    if p.cpu_threads:
        argv += ["--cpu-threads", str(p.cpu_threads)]
    if p.enforce_eager:
        argv.append("--enforce-eager")
    argv += lora_argv(config.lora)
    if s.speculative_config:
        argv += ["--speculative-config", json.dumps(s.speculative_config)]
    argv.append("--enable-prefix-caching" if c.enable_prefix_caching else "--no-enable-prefix-caching")
    argv.append("--enable-chunked-prefill" if s.enable_chunked_prefill else "--no-enable-chunked-prefill")
    argv.append("--async-scheduling" if s.async_scheduling else "--no-async-scheduling")
    return argv
