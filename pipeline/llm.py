"""Offline API: `LLM(model=...).generate(prompts, params)` and the asyncio `AsyncLLM`.

Both start a whole process group (scheduler, workers, detokenizer) in the background through
the launcher (pipeline/engine_group.py), talk to it with the ZMQ client library, and stop it on
`close()`, on context-manager exit and at interpreter exit. `LLM(..., in_process=True)` runs
the same cores in this process instead (pipeline/engine_core.py).
"""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from pagedserve.pipeline.client import AsyncEngineClient, EngineClient
from pagedserve.pipeline.config import EngineConfig
from pagedserve.pipeline.engine_group import EngineGroup
from pagedserve.pipeline.lora_files import BaseShapes
from pagedserve.pipeline.lora_registry import LoRARegistry
from pagedserve.pipeline.lora_request import LoRARequest
from pagedserve.pipeline.messages import AddRequest, DeltaBatch, RequestFailed, RequestRejected
from pagedserve.pipeline.outputs import (EmbeddingOutput, EmbeddingRequestOutput,
                                          RequestError, RequestOutput)
from pagedserve.pipeline.pooling import PoolingParams, from_bytes, truncate
from pagedserve.pipeline.sampling_params import SamplingParams

class LLM:
    """Batch generation (vLLM's `LLM`). By default against a background engine group (the
    launcher's processes); with `in_process=True` on an EngineCore in this process (tensor
    parallel size 1): the same scheduler, worker and detokenizer, stepped by `generate`."""

    def __init__(self, model: str = "Qwen2.5-Coder-0.5B-Instruct", *, in_process: bool = False,
                 **engine_kwargs: Any):
        self._group = self._client = self._core = None
        if in_process:
            self._core = _InProcessEngine(model=model, **engine_kwargs)
            self.tokenizer = self._core.tokenizer
            self._loras = _lora_checks(self._core.core.config)
            return
        self._group = EngineGroup(model=model, **engine_kwargs)
        self.tokenizer = self._group.tokenizer
        self._loras = _lora_checks(self._group.config)
        try:
            self._client = EngineClient(self._group.frontend_addr, self._group.output_addr,
                                        tokenizer=self.tokenizer,
                                        connect_timeout=self._group.start_timeout)
            self._group.wait_ready(lambda: self._client.health(timeout=2.0))
        except BaseException:
            self._group.stop(timeout=10)
            raise

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Outputs in input order; each has .prompt, .outputs[i].text/.token_ids/.finish_reason.
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base
        model; the engine needs enable_lora=True)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        loras = self._lora_requests(lora_request, len(prompts))
        if self._core is not None:
            return self._core.generate(list(zip(prompts, params, loras)))
        futures = [self._client.submit(p, sp, lora=lora)
                   for p, sp, lora in zip(prompts, params, loras)]
        return [f.result() for f in futures]

    def _lora_requests(self, lora_request, count: int) -> list[LoRARequest | None]:
        """One adapter (or None) per prompt, each checked against the model once."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * count
        else:
            loras = list(lora_request)
            if len(loras) != count:
                raise ValueError(f"got {len(loras)} lora_requests for {count} prompts")
        for lora in {lora for lora in loras if lora is not None}:
            _check_lora(self._loras, lora)
        return loras

    def embed(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
              pooling: PoolingParams | None = None) -> list[EmbeddingRequestOutput]:
        """vLLM's `LLM.embed`: each prompt's pooled vector (`.outputs.embedding`), in input
        order; the prompts are batched by the scheduler like any others."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        pooling = pooling or PoolingParams()
        if self._core is not None:
            return self._core.embed(list(prompts), pooling)
        futures = [self._client.submit_embed(p, pooling) for p in prompts]
        return [f.result() for f in futures]

    def chat(self, messages_list: Sequence[Sequence[dict]], params: SamplingParams | None = None
             ) -> list[RequestOutput]:
        prompts = [self.tokenizer.apply_chat_template(list(m), add_generation_prompt=True,
                                                      tokenize=False) for m in messages_list]
        return self.generate(prompts, params)

    def stats(self) -> dict:
        return self._core.core.stats() if self._core is not None else self._client.stats()

    @property
    def client(self) -> EngineClient:
        if self._client is None:
            raise AttributeError("an in-process LLM has no engine client")
        return self._client

    def close(self) -> int | None:
        if self._core is not None:
            return 0
        try:
            self._client.close()
        finally:
            return self._group.stop()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _InProcessEngine:
    """LLM(in_process=True): requests go to an EngineCore, which generate() steps until they
    are all done."""

    def __init__(self, **engine_kwargs: Any):
        from pagedserve.pipeline.engine_core import EngineCore
        engine_kwargs.setdefault("http", False)
        self.core = EngineCore.build(EngineConfig.from_kwargs(**engine_kwargs))
        self.tokenizer = self.core.detokenizer.tokenizer

    def generate(self, requests: list[tuple[Any, SamplingParams, LoRARequest | None]]
                 ) -> list[RequestOutput]:
        outputs: dict[str, RequestOutput] = {}
        try:
            for prompt, params, lora in requests:
                params.validate()
                ids = (list(self.tokenizer.encode(prompt)) if isinstance(prompt, str)
                       else [int(t) for t in prompt])
                rid = uuid.uuid4().hex
                outputs[rid] = RequestOutput.start(rid, prompt if isinstance(prompt, str) else None,
                                                   ids, params)
                self._receive(self.core.submit(AddRequest(
                    request_id=rid, prompt_token_ids=ids, sampling=params,
                    arrival_time=time.time(), lora=lora)), outputs)
            while not all(out.finished for out in outputs.values()):
                self._receive(self.core.step(), outputs)
        except BaseException:
            self.core.abort(*(rid for rid, out in outputs.items() if not out.finished))
            raise
        return list(outputs.values())

    def embed(self, prompts: list, pooling: PoolingParams) -> list[EmbeddingRequestOutput]:
        vectors: dict[str, bytes | None] = {}
        ids_of: dict[str, list[int]] = {}
        try:
            for prompt in prompts:
                rid = uuid.uuid4().hex
                ids_of[rid] = (list(self.tokenizer.encode(prompt)) if isinstance(prompt, str)
                               else [int(t) for t in prompt])
                vectors[rid] = None
                self._take_vectors(self.core.submit(AddRequest(
                    request_id=rid, prompt_token_ids=ids_of[rid],
                    sampling=SamplingParams(max_tokens=None), arrival_time=time.time(),
                    pooling=pooling)), vectors)
            while any(v is None for v in vectors.values()):
                self._take_vectors(self.core.step(), vectors)
        except BaseException:
            self.core.abort(*(rid for rid, v in vectors.items() if v is None))
            raise
        return [EmbeddingRequestOutput(rid, ids_of[rid], EmbeddingOutput(
            truncate(from_bytes(v), pooling.dimensions).tolist())) for rid, v in vectors.items()]

    @staticmethod
    def _take_vectors(msgs: list, vectors: dict[str, bytes | None]) -> None:
        for msg in msgs:
            if isinstance(msg, DeltaBatch):
                for delta in msg.deltas:
                    if delta.embedding is not None:
                        vectors[delta.request_id] = delta.embedding
            elif isinstance(msg, (RequestRejected, RequestFailed)):
                raise RequestError(msg.status, msg.message, msg.request_id)

    @staticmethod
    def _receive(msgs: list, outputs: dict[str, RequestOutput]) -> None:
        for msg in msgs:
            if isinstance(msg, DeltaBatch):
                for delta in msg.deltas:
                    outputs[delta.request_id].apply(delta)
            elif isinstance(msg, (RequestRejected, RequestFailed)):
                raise RequestError(msg.status, msg.message, msg.request_id)


def _check_lora(checks: LoRARegistry | None, lora: LoRARequest) -> None:
    """A caller's adapter fits the model (LoRAFileError naming why), LoRA being on."""
    if checks is None:
        raise ValueError(f"lora_request {lora.lora_name!r} given, but LoRA is disabled "
                         f"(enable_lora=True)")
    checks.check(lora)


def _lora_checks(config: EngineConfig) -> LoRARegistry | None:
    """What LLM.generate checks a lora_request against (None: LoRA is off)."""
    if not config.lora.enable_lora:
        return None
    info = config.model_info
    return LoRARegistry(BaseShapes.from_model_dir(info.model_dir), config.served_model_name,
                        config.lora.max_lora_rank)


class AsyncLLM:
    """asyncio engine: `async for out in engine.generate(prompt, params)` yields cumulative
    RequestOutputs. Create with `await AsyncLLM.create(model=..., ...)`."""

    def __init__(self, group: EngineGroup, client: AsyncEngineClient):
        self._group = group
        self._client = client
        self.tokenizer = group.tokenizer
        self._loras = _lora_checks(group.config)

    @classmethod
    async def create(cls, model: str = "Qwen2.5-Coder-0.5B-Instruct", **engine_kwargs: Any) -> "AsyncLLM":
        import asyncio
        loop = asyncio.get_running_loop()
        group = await loop.run_in_executor(None, lambda: EngineGroup(model=model, **engine_kwargs))
        client = AsyncEngineClient(group.frontend_addr, group.output_addr, tokenizer=group.tokenizer,
                                   connect_timeout=group.start_timeout)
        try:
            await client.connect()
            deadline = time.monotonic() + group.start_timeout
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
        out = RequestOutput.start(kwargs.pop("request_id", None) or uuid.uuid4().hex,
                                  prompt if isinstance(prompt, str) else None, ids, params)
        if "lora_request" in kwargs:   # vLLM's name
            kwargs["lora"] = kwargs.pop("lora_request")
        if kwargs.get("lora") is not None:
            _check_lora(self._loras, kwargs["lora"])
        async for delta in self._client.generate(ids, params, request_id=out.request_id, **kwargs):
            out.apply(delta)
            yield out

    async def embed(self, prompt: str | Sequence[int], pooling: PoolingParams | None = None
                    ) -> EmbeddingRequestOutput:
        """One prompt's pooled vector (`.outputs.embedding`), batched with everything in flight."""
        return await self._client.embed(prompt, pooling)

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
