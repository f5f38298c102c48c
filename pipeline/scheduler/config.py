"""Scheduler settings; names follow vLLM's flags (--max-num-seqs, --max-num-batched-tokens, ...)."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.pipeline.speculative_config import SpeculativeConfig

PREEMPTION_MODES = ("swap", "recompute", "auto")
POLICIES = ("fcfs", "priority")


@dataclass(slots=True)
class SchedulerConfig:
    max_model_len: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_queued_requests: int = 4096  # waiting requests; one more is refused (HTTP 503)
    preemption_mode: str = "auto"
    # "auto": sequences with at least this many tokens are swapped, shorter ones recomputed;
    # None derives it from the default cost model in preemption.py.
    swap_threshold_tokens: int | None = None
    policy: str = "fcfs"
    watermark: float = 0.01  # fraction of device blocks kept free when admitting
    # Steady decodes travel as the plan's decode columns (scheduler/plan.py). False plans every
    # sequence through the general path: the same plans in another encoding, for tests.
    decode_lanes: bool = True
    # The model's vocabulary: every token id a request carries (prompt, resubmitted outputs,
    # stop ids, logit bias) is checked against it at admission. None: not checked.
    vocab_size: int | None = None
    # Scheduler.take_finished() reports finished requests (their service keeps them for a
    # detokenizer re-feed); off, nothing is kept for anyone to take.
    report_finished: bool = False
    # The model's sampling defaults (pipeline/generation_defaults.py): admission fills a
    # request's unset sampling fields from them.
    generation_defaults: dict = field(default_factory=dict)
    # The model's sliding window when every layer attends only that many positions back
    # (Mistral): blocks that slid out of it are released while a sequence runs, and a request
    # needs room for its window, not its length. 0: no window (or some global layers).
    sliding_window: int = 0
    # N-gram speculative decoding (scheduler/speculative.py); None: off.
    speculative: SpeculativeConfig | None = None
    # Embeddings (pipeline/pooling.py): the model's pooling reads every prompt token's hidden
    # state (MEAN, CLS, or an encoder's bidirectional attention), so a pooling prompt is
    # computed in one step and never from cached blocks; an encoder serves pooling only.
    pooling_whole_prompt: bool = False
    encoder_only: bool = False
    # LoRA (--enable-lora): the distinct adapters one step may use (--max-loras); 0: off.
    max_loras: int = 0

    def __post_init__(self) -> None:
        for name in ("max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens",
                     "max_queued_requests"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                             f"got {self.preemption_mode!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if (not isinstance(self.sliding_window, int) or isinstance(self.sliding_window, bool)
                or self.sliding_window < 0):
            raise ValueError(f"sliding_window must be an integer >= 0 (0: none), got "
                             f"{self.sliding_window!r}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.swap_threshold_tokens is not None and self.swap_threshold_tokens < 0:
            raise ValueError(f"swap_threshold_tokens must be >= 0, got {self.swap_threshold_tokens}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs}) so every running sequence can decode each step")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be at least max_model_len ({self.max_model_len}) or long prompts never run; "
                f"raise it or enable chunked prefill")

    @classmethod
    def from_engine(cls, cfg) -> "SchedulerConfig":
        """The scheduler's part of an EngineConfig (whose model the launcher resolved)."""
        s = cfg.scheduling
        return cls(max_model_len=cfg.max_model_len, block_size=cfg.cache.block_size,
                   max_num_seqs=s.max_num_seqs,
                   max_num_batched_tokens=max(s.max_num_batched_tokens, s.max_num_seqs),
                   enable_chunked_prefill=s.enable_chunked_prefill,
                   enable_prefix_caching=cfg.cache.enable_prefix_caching,
                   max_queued_requests=s.max_queued_requests, preemption_mode=s.preemption_mode,
                   policy=s.scheduling_policy, vocab_size=cfg.model_info.vocab_size or None,
                   report_finished=True, sliding_window=cfg.model_info.sliding_window,
                   generation_defaults=dict(cfg.model_info.generation_defaults),
                   speculative=SpeculativeConfig.parse(s.speculative_config),
                   pooling_whole_prompt=cfg.model_info.pooler().whole_prompt
                   or cfg.model_info.is_encoder,
                   encoder_only=cfg.model_info.is_encoder,
                   max_loras=cfg.lora.device_slots)
