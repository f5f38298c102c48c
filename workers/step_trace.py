"""Where a worker's step time goes, for PAGEDSERVE_STEP_TRACE (diagnostics only).

`StepProfiler` puts forward hooks on the decoder's linears and attention modules and adds up,
per step, the time spent in the linears (matmuls) and in attention proper (each attention
module's time less that of its own projections); the worker reports them with the forward's
and the sampling's totals in StepResult.timings, and the scheduler writes them to the trace
(pipeline/scheduler/process.py). The hooks cost a few microseconds a module, so a traced step
is a little slower than an untraced one: compare traced runs with traced runs. Decode steps that
replay natively (workers/cpu_decode_replay.py) call no module: the replay times its own kernel
calls by kind, and those add in.
"""
from __future__ import annotations

import time

import numpy as np
from torch import nn

from pagedserve.kernels.native_replay import OP_KINDS
from pagedserve.workers.models.decoder import DecoderAttention
from pagedserve.workers.models.layers import PackableLinear


class StepProfiler:
    def __init__(self, model: nn.Module, replay=None) -> None:
        self.replay = replay   # a CpuDecodeReplay (or None): it times its kernel calls
        if replay is not None:
            replay.seconds = np.zeros(OP_KINDS)
        self.seconds = {"linear": 0.0, "attention": 0.0, "projection": 0.0}
        projections = {id(m) for a in model.modules() if isinstance(a, DecoderAttention)
                       for m in a.modules() if isinstance(m, PackableLinear)}
        for module in model.modules():
            if isinstance(module, DecoderAttention):
                self._hook(module, ("attention",))
            elif isinstance(module, PackableLinear):  # the LM head is not called as a module
                self._hook(module, ("linear", "projection") if id(module) in projections
                           else ("linear",))

    def _hook(self, module: nn.Module, kinds: tuple[str, ...]) -> None:
        started = [0.0]
        seconds = self.seconds

        def before(_module, _args):
            started[0] = time.perf_counter()

        def after(_module, _args, _out):
            spent = time.perf_counter() - started[0]
            for kind in kinds:
                seconds[kind] += spent
        module.register_forward_pre_hook(before)
        module.register_forward_hook(after)

    def take(self) -> dict[str, float]:
        """Milliseconds since the last take: matmul (the decoder's linears) and attention
        (attention modules less their projections)."""
        s = self.seconds
        out = {"matmul_ms": s["linear"] * 1e3,
               "attention_ms": (s["attention"] - s["projection"]) * 1e3}
        for key in s:
            s[key] = 0.0
        if self.replay is not None:
            for key, ms in self.replay.take_seconds().items():
                out[key] += ms
        return out
