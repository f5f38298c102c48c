"""A rank's LoRA adapters: loaded into host memory once (least recently used dropped past
--max-cpu-loras), given one of --max-loras device slots for the steps that use them (least
recently used slot reused), and each step's rows mapped to their slots.

Slots are this rank's own business: the scheduler only guarantees that no step uses more
adapters than there are slots (StepAdapters in pipeline/scheduler/step_rule.py), and every NewSeq names its
adapter, so a restarted worker loads again whatever its sequences use.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from pagedserve.pipeline.lora_files import BaseShapes
from pagedserve.pipeline.lora_request import LoRARequest
from pagedserve.workers.lora.adapter import LoadedAdapter, load_adapter
from pagedserve.workers.lora.stack import LoRABatch, LoRAStack, StepLoRA

log = logging.getLogger(__name__)


def attach_stacks(model: nn.Module, num_slots: int, max_rank: int, step: StepLoRA,
                  device: torch.device) -> list[list[LoRAStack]]:
    """A LoRAStack on each adaptable linear of every decoder layer: per layer, its stacks."""
    layers = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if getattr(mlp, "merged", False):
            raise ValueError(f"LoRA: a {type(model).__name__}'s fused gate_up_proj is not "
                             f"supported")
        found = [(attn.qkv_proj, ("q_proj", "k_proj", "v_proj")), (attn.o_proj, ("o_proj",)),
                 (mlp.gate_up_proj, ("gate_proj", "up_proj")), (mlp.down_proj, ("down_proj",))]
        stacks = []
        for linear, modules in found:
            linear.lora = LoRAStack(linear, modules, num_slots, max_rank, step, device)
            stacks.append(linear.lora)
        layers.append(stacks)
    return layers


class LoRAManager:
    def __init__(self, model: nn.Module, base: BaseShapes, num_slots: int, max_rank: int,
                 cpu_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        self.base, self.max_rank, self.dtype, self.device = base, max_rank, dtype, device
        self.cpu_slots = max(cpu_slots, num_slots)
        self.step = StepLoRA()
        self.layers = attach_stacks(model, num_slots, max_rank, self.step, device)
        self.host: OrderedDict[int, LoadedAdapter] = OrderedDict()
        self.requests: dict[int, LoRARequest] = {}
        self.slots: list[int | None] = [None] * num_slots   # adapter id per slot
        self.slot_lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(num_slots))

    def register(self, lora: LoRARequest) -> None:
        """A sequence of this adapter arrived: load it into host memory unless it is there
        (an id seen before with another path is that path's adapter from now on)."""
        lora_id = lora.lora_int_id
        known = self.requests.get(lora_id)
        if known is not None and known.lora_path != lora.lora_path:
            self.host.pop(lora_id, None)
            self.slots = [None if held == lora_id else held for held in self.slots]
        self.requests[lora_id] = lora
        self._host(lora_id)

    def _host(self, lora_id: int) -> LoadedAdapter:
        adapter = self.host.get(lora_id)
        if adapter is not None:
            self.host.move_to_end(lora_id)
            return adapter
        lora = self.requests[lora_id]
        adapter = load_adapter(lora, self.base, self.max_rank, self.dtype)
        log.info("LoRA adapter %r (id %d, rank %d) loaded into host memory (%.1f MiB)",
                 lora.lora_name, lora_id, adapter.rank, adapter.nbytes / 2**20)
        self.host[lora_id] = adapter
        while len(self.host) > self.cpu_slots:
            evicted, _ = self.host.popitem(last=False)
            log.info("LoRA adapter id %d dropped from host memory (--max-cpu-loras %d)",
                     evicted, self.cpu_slots)
        return adapter

    def prepare(self, item_ids: np.ndarray, first_rows: np.ndarray, lens: np.ndarray,
                num_rows: int) -> bool:
        """Map a step's rows to slots: `item_ids` is each item's adapter id (0: none), in
        item order, with its first row and row count. Whether any row uses an adapter."""
        self.step.batch = None
        used = np.unique(item_ids[item_ids > 0])
        if not used.size:
            return False
        slot_of = self._activate([int(i) for i in used])
        item_slots = np.full(len(item_ids), -1, np.int64)
        for lora_id, slot in slot_of.items():
            item_slots[item_ids == lora_id] = slot
        row_slots = np.full(num_rows, -1, np.int64)
        adapted = np.flatnonzero(item_slots >= 0)
        row_slots[np.repeat(first_rows[adapted], lens[adapted]) + _ramps(lens[adapted])] = \
            np.repeat(item_slots[adapted], lens[adapted])
        rows = np.flatnonzero(row_slots >= 0)
        rows = rows[np.argsort(row_slots[rows], kind="stable")]
        slots, counts = np.unique(row_slots[rows], return_counts=True)
        starts = np.zeros(len(slots) + 1, np.int64)
        np.cumsum(counts, out=starts[1:])
        to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(self.device)  # noqa: E731
        self.step.batch = LoRABatch(num_rows, to(rows), to(starts), to(slots))
        return True

    def prepare_items(self, items, first_rows: np.ndarray, num_rows: int) -> bool:
        """`prepare` for a step's SeqSteps (their lora_id, first rows in item order)."""
        n = len(items)
        item_ids = np.fromiter((it.lora_id for it in items), np.int64, n)
        if not item_ids.any():
            self.step.batch = None
            return False
        lens = np.fromiter((len(it.token_ids) for it in items), np.int64, n)
        return self.prepare(item_ids, first_rows, lens, num_rows)

    def finish_step(self) -> None:
        self.step.batch = None

    def _activate(self, lora_ids: list[int]) -> dict[int, int]:
        """A slot for each adapter of the step (loading the missing ones into the least
        recently used slots the step does not need): adapter id -> slot."""
        if len(lora_ids) > len(self.slots):
            raise ValueError(f"a step uses {len(lora_ids)} LoRA adapters but this worker has "
                             f"{len(self.slots)} slots (--max-loras)")
        slot_of = {lid: self.slots.index(lid) for lid in lora_ids if lid in self.slots}
        for lora_id in lora_ids:
            if lora_id not in slot_of:
                free = next(s for s in self.slot_lru if self.slots[s] not in slot_of)
                self._write(free, lora_id)
                slot_of[lora_id] = free
        for slot in slot_of.values():
            self.slot_lru.move_to_end(slot)
        return slot_of

    def _write(self, slot: int, lora_id: int) -> None:
        adapter = self._host(lora_id)
        for index, stacks in enumerate(self.layers):
            weights = adapter.layers.get(index, {})
            for stack in stacks:
                stack.write(slot, weights)
        self.slots[slot] = lora_id


def _ramps(counts: np.ndarray) -> np.ndarray:
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return np.arange(int(counts.sum())) - starts
