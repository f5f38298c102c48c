"""Offline API: `LLM(model=...).generate(prompts, params)` and the asyncio `AsyncLLM`.

Both start a whole process group (scheduler, workers, detokenizer) in the background through
the launcher, talk to it with the ZMQ client library, and stop it on `close()`, on
context-manager exit and at interpreter exit.
"""
from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from pagedserve.pipeline.client import AsyncEngineClient, EngineClient
from pagedserve.pipeline.config import EngineConfig
from pagedserve.pipeline.outputs import CompletionOutput, RequestOutput
from pagedserve.pipeline.sampling_params import SamplingParams

START_TIMEOUT_S = float(os.environ.get("PAGEDSERVE_START_TIMEOUT", "900"))


class EngineGroup:
    """A launcher subprocess running one engine group, with its socket addresses."""

    def __init__(self, **engine_kwargs: Any):
        from pagedserve.workers.loader import load_tokenizer, resolve_model

        engine_kwargs.setdefault("http", False)
        config = EngineConfig.from_kwargs(**engine_kwargs)
        self.model_dir = resolve_model(config.model.model)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.ipc_dir = tempfile.mkdtemp(prefix="pagedserve-")
        config.ipc.ipc_dir = self.ipc_dir
        config.ipc.fill_defaults()
        self.frontend_addr = config.ipc.frontend_addr
        self.output_addr = config.ipc.output_addr
        argv = _config_to_argv(config, str(self.model_dir))
        self.proc = subprocess.Popen([sys.executable, "-m", "pagedserve.pipeline.launch", *argv],
                                     start_new_session=True)
        atexit.register(self.stop)

    def wait_ready(self, client_health) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the engine group exited with code {self.proc.returncode} "
                                   "during start-up (its log is above)")
            if client_health():
                return
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"the engine group was not ready within {START_TIMEOUT_S:.0f}s")

    def stop(self, timeout: float = 120.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        atexit.unregister(self.stop)
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
            "--max-restarts", str(config.supervisor.max_restarts),
            "--restart-window", str(config.supervisor.restart_window),
            "--heartbeat-timeout", str(config.supervisor.heartbeat_timeout),
            "--ipc-dir", config.ipc.ipc_dir, "--no-http", "--die-with-parent"]
    if m.served_model_name:
        argv += ["--served-model-name", m.served_model_name]
    if m.max_model_len:
        argv += ["--max-model-len", str(m.max_model_len)]
    if c.kv_cache_memory:
        argv += ["--kv-cache-memory", str(c.kv_cache_memory)]
    if p.cpu_threads:
        argv += ["--cpu-threads", str(p.cpu_threads)]
    if p.enforce_eager:
        argv.append("--enforce-eager")
    argv.append("--enable-prefix-caching" if c.enable_prefix_caching else "--no-enable-prefix-caching")
    argv.append("--enable-chunked-prefill" if s.enable_chunked_prefill else "--no-enable-chunked-prefill")
    return argv


class LLM:
    """Batch generation against a background engine group (vLLM's `LLM`)."""

    def __init__(self, model: str = "SmolLM2-135M-Instruct", **engine_kwargs: Any):
        self._group = EngineGroup(model=model, **engine_kwargs)
        self.tokenizer = self._group.tokenizer
        try:
            self._client = EngineClient(self._group.frontend_addr, self._group.output_addr,
                                        tokenizer=self.tokenizer, connect_timeout=START_TIMEOUT_S)
            self._group.wait_ready(lambda: self._client.health(timeout=2.0))
        except BaseException:
            self._group.stop(timeout=10)
            raise

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Outputs in input order; each has .prompt, .outputs[i].text/.token_ids/.finish_reason."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        futures = [self._client.submit(p, sp) for p, sp in zip(prompts, params)]
        return [f.result() for f in futures]

    def chat(self, messages_list: Sequence[Sequence[dict]], params: SamplingParams | None = None
             ) -> list[RequestOutput]:
        prompts = [self.tokenizer.apply_chat_template(list(m), add_generation_prompt=True,
                                                      tokenize=False) for m in messages_list]
        return self.generate(prompts, params)

    def stats(self) -> dict:
        return self._client.stats()

    @property
    def client(self) -> EngineClient:
        return self._client

    def close(self) -> int | None:
        try:
            self._client.close()
        finally:
            return self._group.stop()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncLLM:
    """asyncio engine: `async for out in engine.generate(prompt, params)` yields cumulative
    RequestOutputs. Create with `await AsyncLLM.create(model=..., ...)`."""

    def __init__(self, group: EngineGroup, client: AsyncEngineClient):
        self._group = group
        self._client = client
        self.tokenizer = group.tokenizer

    @classmethod
    async def create(cls, model: str = "SmolLM2-135M-Instruct", **engine_kwargs: Any) -> "AsyncLLM":
        import asyncio
        loop = asyncio.get_running_loop()
        group = await loop.run_in_executor(None, lambda: EngineGroup(model=model, **engine_kwargs))
        client = AsyncEngineClient(group.frontend_addr, group.output_addr, tokenizer=group.tokenizer,
                                   connect_timeout=START_TIMEOUT_S)
        try:
            await client.connect()
            deadline = time.monotonic() + START_TIMEOUT_S
            while not await client.health(timeout=2.0):
                if group.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the engine group did not become ready")
                await asyncio.sleep(0.2)
        except BaseException:
            await client.close()
            await loop.run_in_executor(None, group.stop)
            raise
        return cls(group, client)

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                       **kwargs: Any) -> AsyncIterator[RequestOutput]:
        params = params or SamplingParams()
        ids = self._client._prompt_ids(prompt)
        out = RequestOutput(request_id=kwargs.pop("request_id", None) or uuid.uuid4().hex,
                            prompt=prompt if isinstance(prompt, str) else None,
                            prompt_token_ids=ids,
                            outputs=[CompletionOutput(index=i) for i in range(params.n)])
        async for delta in self._client.generate(ids, params, request_id=out.request_id, **kwargs):
            out.apply(delta)
            yield out

    async def abort(self, request_id: str) -> None:
        await self._client.abort(request_id)

    async def stats(self) -> dict:
        return await self._client.stats()

    async def close(self) -> None:
        import asyncio
        await self._client.close()
        await asyncio.get_running_loop().run_in_executor(None, self._group.stop)

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
