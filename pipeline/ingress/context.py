"""What every route needs: the engine client, tokenizer, model limits, metrics, admission."""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedserve.pipeline.ingress.admission import AdmissionController
from pagedserve.pipeline.ingress.errors import overloaded
from pagedserve.pipeline.ingress.metrics import IngressMetrics
from pagedserve.pipeline.ingress.request_guard import RequestGuard
from pagedserve.pipeline.ingress.tokens import TokenText
from pagedserve.pipeline.ingress.tools import resolve_tool_parser
from pagedserve.pipeline.lora_registry import LoRARegistry

log = logging.getLogger("pagedserve.ingress")

MAX_N = 128
STATS_TIMEOUT_S = 2.0
STATS_REFRESH_S = 1.0  # while requests run, refresh the admission view at most this often


@dataclass(eq=False)
class IngressContext:
    engine: Any  # AsyncEngineClient, or any object with its generate/abort/stats/health
    tokenizer: Any
    served_model_names: list[str]
    max_model_len: int
    vocab_size: int
    admission: AdmissionController
    model_root: str = ""
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    max_n: int = MAX_N
    tool_call_parser: str | None = None   # --tool-call-parser
    reasoning_parser: str | None = None   # --reasoning-parser
    hidden_size: int = 0                  # an embedding's length (`dimensions` <= it)
    is_encoder: bool = False              # embeddings only (BERT)
    loras: LoRARegistry | None = None     # --enable-lora: the adapters served by name
    lora_state_file: str | None = None    # where they are kept for a restart (lora_routes.py)
    clock: Callable[[], float] = time.monotonic
    guard: RequestGuard = field(default_factory=RequestGuard)  # quarantine (request_guard.py)
    metrics: IngressMetrics = field(init=False)
    token_text: TokenText = field(init=False)
    _stats_task: asyncio.Task | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.metrics = IngressMetrics(self.served_model_names[0])
        self.token_text = TokenText(self.tokenizer)
        dispatcher = getattr(self.engine, "dispatcher", None)
        if dispatcher is not None:  # the same Counter: /metrics shows it as it grows
            self.metrics.engine.local_unknown = dispatcher.unknown

    @classmethod
    def from_config(cls, cfg, engine: Any, tokenizer: Any) -> "IngressContext":
        """cfg: an EngineConfig whose model_info the launcher resolved."""
        from pagedserve.pipeline.ingress.lora_routes import build_registry
        state_file = os.path.join(cfg.ipc.ipc_dir, "lora_adapters.json") \
            if cfg.ipc.ipc_dir else None
        return cls(engine=engine, tokenizer=tokenizer, served_model_names=[cfg.served_model_name],
                   max_model_len=cfg.max_model_len, vocab_size=cfg.model_info.vocab_size,
                   admission=AdmissionController(cfg.scheduling.max_queued_requests,
                                                 cfg.scheduling.max_num_seqs),
                   model_root=cfg.model.model, api_key=cfg.server.api_key,
                   max_request_bytes=cfg.server.max_request_bytes,
                   max_n=min(MAX_N, cfg.scheduling.max_num_seqs),
                   tool_call_parser=resolve_tool_parser(
                       cfg.server.tool_call_parser, getattr(tokenizer, "chat_template", None)),
                   reasoning_parser=cfg.server.reasoning_parser,
                   hidden_size=cfg.model_info.hidden_size, is_encoder=cfg.model_info.is_encoder,
                   loras=build_registry(cfg.lora, cfg.model_info.model_dir,
                                        cfg.served_model_name, state_file),
                   lora_state_file=state_file if cfg.lora.enable_lora else None)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    # -- admission ---------------------------------------------------------------------------
    def admit(self, num_requests: int) -> "Ticket":
        """Hold `num_requests` in-flight slots, or raise 503 without having tokenized anything."""
        now = self.clock()
        reason = self.admission.refusal(num_requests, now)
        if reason is not None:
            raise overloaded(f"The server is overloaded: {reason}. Retry later.")
        self.admission.enter(num_requests)
        if self.admission.snapshot_age(now) > STATS_REFRESH_S:
            self._refresh_in_background()
        return Ticket(self.admission, num_requests)

    def _refresh_in_background(self) -> None:
        if self._stats_task is None or self._stats_task.done():
            self._stats_task = asyncio.ensure_future(self.refresh_stats())

    async def refresh_stats(self) -> bool:
        """Ask the scheduler for its stats; keep the last snapshot when it does not answer."""
        try:
            stats = await asyncio.wait_for(self.engine.stats(), STATS_TIMEOUT_S)
        except Exception as exc:  # an unreachable engine shows in /health; metrics stay stale
            log.debug("stats refresh failed: %s", exc)
            return False
        if not isinstance(stats, dict):
            return False
        self.metrics.engine.snapshot = stats
        self.admission.observe_stats(stats, self.clock())
        return True


class Ticket:
    """In-flight slots of one HTTP request; released exactly once."""

    __slots__ = ("_admission", "_count")

    def __init__(self, admission: AdmissionController, count: int):
        self._admission = admission
        self._count = count

    def release(self) -> None:
        if self._count:
            self._admission.leave(self._count)
            self._count = 0
