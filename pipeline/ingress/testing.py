"""Test doubles for the ingress: a tiny byte-level tokenizer with a ChatML template, and a fake
engine client with AsyncEngineClient's generate/abort/stats/health over a deterministic toy
"model". Used by tests/pipeline/test_ingress_*.py; no model files, no processes.
"""
from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pagedserve.pipeline.messages import PromptLogprobs, TextDelta
from pagedserve.pipeline.outputs import RequestError
from pagedserve.pipeline.pooling import PoolingParams, to_bytes
from pagedserve.pipeline.sampling_params import SamplingParams

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@functools.lru_cache(maxsize=1)
def make_tiny_tokenizer():
    """(Cached; treat as read-only.) Byte-level BPE with no merges: 256 byte tokens (one token per byte of text), then the
    ChatML specials, so token counts in tests are simply byte counts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda ch: _byte_of(ch))
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   bos_token="<|im_start|>", unk_token="<|endoftext|>",
                                   additional_special_tokens=[])
    fast.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    fast.chat_template = CHATML_TEMPLATE
    return fast


def _byte_of(ch: str) -> int:
    from pagedserve.pipeline.ingress.tokens import _BYTE_OF_CHAR
    return _BYTE_OF_CHAR[ch]


@dataclass
class Submitted:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    pooling: PoolingParams | None = None


FAKE_HIDDEN_SIZE = 8


def fake_embedding(prompt_ids: list[int]) -> list[float]:
    """The fake engine's vector of a prompt: unit length, FAKE_HIDDEN_SIZE long."""
    import numpy as np
    raw = np.array([(sum(prompt_ids) * (k + 1)) % 17 + 1 for k in range(FAKE_HIDDEN_SIZE)],
                   dtype=np.float32)
    return (raw / np.linalg.norm(raw)).astype(np.float32).tolist()


TOY_ALPHABET = "abcdefghij "


@dataclass
class FakeEngine:
    """Each sample emits characters of TOY_ALPHABET, one token per step, starting at a position
    that depends on (sum of prompt ids, sample index, seed). `eos_after` tokens then EOS (unless
    ignore_eos); stop strings end a sample like the detokenizer does (trimmed, reason "stop").
    `step_delay` seconds between steps; `reject` raises that RequestError on submission."""

    tokenizer: Any
    eos_after: int | None = None
    step_delay: float = 0.0
    reject: RequestError | None = None
    healthy: bool = True
    stats_result: dict[str, Any] = field(default_factory=dict)
    submitted: list[Submitted] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    running: set[str] = field(default_factory=set)
    drop_prompt_logprobs: bool = False  # send only the first chunk of prompt logprobs

    @property
    def eos_token_id(self) -> int:
        return self.tokenizer.convert_tokens_to_ids("<|im_end|>")

    def next_char(self, prompt_ids: list[int], index: int, seed: int | None, step: int) -> str:
        start = sum(prompt_ids) + 3 * index + (seed or 0)
        return TOY_ALPHABET[(start + step) % len(TOY_ALPHABET)]

    async def generate(self, prompt: list[int], params: SamplingParams | None = None, *,
                       request_id: str | None = None, priority: int = 0,
                       cache_salt: str | None = None, pooling: PoolingParams | None = None
                       ) -> AsyncIterator[TextDelta]:
        params = params or SamplingParams()
        params.validate()
        request_id = request_id or uuid.uuid4().hex
        self.submitted.append(Submitted(request_id, list(prompt), params, priority, cache_salt,
                                        pooling))
        if self.reject is not None:
            raise self.reject
        if pooling is not None:  # an embedding request: one finished delta with the vector
            await asyncio.sleep(self.step_delay)
            self.finished.append(request_id)
            yield TextDelta(request_id=request_id, index=0, text="", token_ids=[],
                            finish_reason="stop", num_prompt_tokens=len(prompt),
                            embedding=to_bytes(fake_embedding(list(prompt))))
            return
        self.running.add(request_id)
        open_samples = set(range(params.n))
        texts = [""] * params.n
        try:
            chunks = fake_prompt_logprobs(list(prompt), params.prompt_logprobs)
            for chunk in chunks[:1] if self.drop_prompt_logprobs else chunks:
                yield TextDelta(request_id=request_id, index=0, text="", token_ids=[],
                                prompt_logprobs=chunk, num_prompt_tokens=len(prompt))
            step = 0
            while open_samples:
                await asyncio.sleep(self.step_delay)
                for i in sorted(open_samples):
                    delta = self._step(request_id, list(prompt), params, i, step, texts)
                    if delta.finish_reason is not None:
                        open_samples.discard(i)
                    yield delta
                step += 1
            self.finished.append(request_id)
        finally:
            self.running.discard(request_id)
            if open_samples:
                self.aborted.append(request_id)

    def _step(self, request_id: str, prompt: list[int], params: SamplingParams, index: int,
              step: int, texts: list[str]) -> TextDelta:
        n_out = step + 1
        if self.eos_after is not None and step == self.eos_after and not params.ignore_eos:
            token, text, finish, reason = self.eos_token_id, "", "stop", self.eos_token_id
        else:
            ch = self.next_char(prompt, index, params.seed, step)
            token, text = self.tokenizer.convert_tokens_to_ids(ch.replace(" ", "Ġ")), ch
            finish, reason = None, None
            texts[index] += text
            for stop in params.stop:
                if stop in texts[index]:
                    cut = texts[index].index(stop)
                    text = text[:max(0, len(text) - (len(texts[index]) - cut))]
                    finish, reason = "stop", stop
                    break
            if finish is None and params.max_tokens is not None and n_out >= params.max_tokens:
                finish = "length"
        logprobs = top = None
        if params.logprobs is not None:
            logprobs = [-0.5]
            # the chosen token first, then made-up runners-up (byte tokens 200, 201, ...)
            top = [[(token, -0.5)] + [(200 + k, -2.0 - k) for k in range(params.logprobs - 1)]
                   if params.logprobs else []]
        return TextDelta(request_id=request_id, index=index, text=text, token_ids=[token],
                         token_offset=step, text_offset=len(texts[index]) - len(text),
                         logprobs=logprobs, top_logprobs=top, finish_reason=finish,
                         stop_reason=reason, num_prompt_tokens=len(prompt),
                         num_output_tokens=n_out)

    async def abort(self, *request_ids: str) -> None:
        self.aborted.extend(request_ids)

    async def stats(self) -> dict[str, Any]:
        return dict(self.stats_result)

    async def health(self, timeout: float = 5.0) -> bool:
        return self.healthy


def fake_prompt_logprobs(prompt: list[int], top_n: int | None) -> list[PromptLogprobs]:
    """FakeEngine's prompt logprobs, in two chunks: prompt token p has -p / 10, and the top-N
    are byte tokens 200, 201, ... at -0.05, -1.05, ... (so a prompt token is never among them)."""
    if top_n is None or len(prompt) < 2:
        return []
    logprobs = [-p / 10 for p in range(1, len(prompt))]
    tops = [[(200 + k, -0.05 - k) for k in range(top_n)] for _ in logprobs]
    half = (len(logprobs) + 1) // 2
    return [PromptLogprobs(1 + at, logprobs[at:at + half], tops[at:at + half])
            for at in range(0, len(logprobs), half)]


def make_test_context(tokenizer=None, *, max_model_len: int = 64, max_queued_requests: int = 8,
                      max_num_seqs: int = 4, api_key: str | None = None,
                      max_request_bytes: int = 1 << 16, **engine_kwargs):
    """(IngressContext over a FakeEngine, that FakeEngine); model name "tiny"."""
    from pagedserve.pipeline.ingress.admission import AdmissionController
    from pagedserve.pipeline.ingress.context import IngressContext

    tokenizer = tokenizer or make_tiny_tokenizer()
    engine = FakeEngine(tokenizer, **engine_kwargs)
    ctx = IngressContext(engine=engine, tokenizer=tokenizer, served_model_names=["tiny"],
                         max_model_len=max_model_len, vocab_size=len(tokenizer),
                         admission=AdmissionController(max_queued_requests, max_num_seqs),
                         api_key=api_key, max_request_bytes=max_request_bytes,
                         hidden_size=FAKE_HIDDEN_SIZE)
    return ctx, engine


def run_with_client(test, tokenizer=None, **ctx_kwargs) -> None:
    """Run `await test(client, ctx, engine)` against a fresh app over a FakeEngine
    (`make_test_context(tokenizer, **ctx_kwargs)`)."""
    import asyncio

    import httpx

    from pagedserve.pipeline.ingress.app import build_app

    async def main():
        ctx, engine = make_test_context(tokenizer, **ctx_kwargs)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(ctx)),
                                     base_url="http://test") as client:
            await test(client, ctx, engine)
    asyncio.run(main())
