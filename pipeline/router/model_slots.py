"""Which models hold engine groups: at most `max_loaded` at once, loaded on first request,
the least recently used idle one evicted to make room.

Pure bookkeeping with the clock as an argument; `ModelManager` starts and stops the groups it
decides. A model being loaded or unloaded holds its slot until that finishes.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class ModelState(enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"


@dataclass(slots=True)
class _Slot:
    state: ModelState = ModelState.UNLOADED
    last_used: float = float("-inf")
    in_flight: int = 0


@dataclass(frozen=True, slots=True)
class LoadPlan:
    load: str | None           # start loading this model now
    evict: str | None          # unload this one first (its slot goes to `load` after)
    ready: bool = False        # the model is loaded: send the request
    wait: bool = False         # nothing to do now: wait for a load or an unload to finish


@dataclass(slots=True)
class ModelSlots:
    models: list[str]
    max_loaded: int | None = None   # None: every model may be loaded at once
    _slots: dict[str, _Slot] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("at least one model is needed")
        if len(set(self.models)) != len(self.models):
            raise ValueError(f"a model is named twice: {self.models}")
        if self.max_loaded is not None and self.max_loaded < 1:
            raise ValueError(f"--max-loaded-models must be at least 1, got {self.max_loaded}")
        self._slots = {m: _Slot() for m in self.models}

    def state(self, model: str) -> ModelState:
        return self._slot(model).state

    def _slot(self, model: str) -> _Slot:
        try:
            return self._slots[model]
        except KeyError:
            raise KeyError(f"model {model!r} is not served (served: "
                           f"{', '.join(self.models)})") from None

    def occupied(self) -> int:
        return sum(s.state is not ModelState.UNLOADED for s in self._slots.values())

    def plan(self, model: str) -> LoadPlan:
        """What serving `model` needs now. Only a loaded model with nothing in flight is
        evicted, the least recently used first; with none, the request waits."""
        slot = self._slot(model)
        if slot.state is ModelState.LOADED:
            return LoadPlan(None, None, ready=True)
        if slot.state in (ModelState.LOADING, ModelState.UNLOADING):
            return LoadPlan(None, None, wait=True)
        if self.max_loaded is None or self.occupied() < self.max_loaded:
            return LoadPlan(model, None)
        idle = [(s.last_used, m) for m, s in self._slots.items()
                if s.state is ModelState.LOADED and s.in_flight == 0]
        if not idle:
            return LoadPlan(None, None, wait=True)
        return LoadPlan(model, min(idle)[1])

    def loading(self, model: str) -> None:
        self._slot(model).state = ModelState.LOADING

    def loaded(self, model: str, now: float) -> None:
        slot = self._slot(model)
        slot.state, slot.last_used = ModelState.LOADED, now

    def unloading(self, model: str) -> None:
        self._slot(model).state = ModelState.UNLOADING

    def unloaded(self, model: str) -> None:
        """Also after a failed load: the slot is free again."""
        self._slot(model).state = ModelState.UNLOADED

    def begin(self, model: str, now: float) -> None:
        """A request started on `model` (loaded): it is not evicted while any runs."""
        slot = self._slot(model)
        slot.in_flight += 1
        slot.last_used = now

    def end(self, model: str, now: float) -> None:
        slot = self._slot(model)
        slot.in_flight = max(0, slot.in_flight - 1)
        slot.last_used = now

    def loaded_models(self) -> list[str]:
        return [m for m, s in self._slots.items() if s.state is ModelState.LOADED]
