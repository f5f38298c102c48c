"""Fault injection for tests and by hand: `PAGEDSERVE_FAULT=<role>:<kind>[@<trigger>][;...]`.

Roles are the launcher's names: scheduler, worker0, worker1, ..., detokenizer, ingress.
Kinds:  crash      SIGKILL itself
        abort      SIGABRT itself (as a native crash would: the launcher holds it against what ran)
        raise      raise FaultInjected (the role's normal error path runs)
        hang       stop responding (sleep forever, sockets untouched)
        slow=<ms>  sleep that long before handling each message
Triggers: step=<N> (scheduler and workers: the first step >= N), msg=<N> (the N-th message
handled, any role), start (right after the role reports ready), token=<id> (workers: the first
plan that sends a sequence whose prompt holds that token id; detokenizer and ingress: the first
request whose prompt holds it - a "poison request"). Without a
trigger, crash/raise/hang fire at the first message. A spec fires in the first incarnation of a role only, unless it
ends in `!` (e.g. `worker0:crash@start!`), which fires after every restart: a crash loop.

Example: PAGEDSERVE_FAULT="worker1:crash@step=40;detokenizer:slow=50"
"""
from __future__ import annotations

import os
import resource
import signal
import time
from dataclasses import dataclass

ENV = "PAGEDSERVE_FAULT"  # read once by the launcher (pagedserve/envs.py), handed to each role


class FaultInjected(RuntimeError):
    """Raised by a `raise` fault."""


@dataclass(frozen=True, slots=True)
class FaultSpec:
    role: str
    kind: str            # crash | raise | hang | slow
    slow_ms: float = 0.0
    trigger: str = ""    # "" | "step" | "msg" | "start" | "token"
    at: int = 0
    every_incarnation: bool = False


def parse(text: str) -> list[FaultSpec]:
    specs = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        every = part.endswith("!")
        part = part.rstrip("!")
        role, sep, rest = part.partition(":")
        if not sep or not role:
            raise ValueError(f"{ENV}: {part!r} is not <role>:<kind>[@<trigger>]")
        what, _, trigger = rest.partition("@")
        kind, _, arg = what.partition("=")
        if kind not in ("crash", "abort", "raise", "hang", "slow"):
            raise ValueError(f"{ENV}: unknown fault kind {kind!r} in {part!r} "
                             "(crash, abort, raise, hang, slow=<ms>)")
        slow_ms = float(arg) if kind == "slow" else 0.0
        if kind == "slow" and slow_ms <= 0:
            raise ValueError(f"{ENV}: slow needs a positive delay in ms, e.g. slow=50")
        trig, at = "", 0
        if trigger:
            trig, _, num = trigger.partition("=")
            if trig not in ("step", "msg", "start", "token"):
                raise ValueError(f"{ENV}: unknown trigger {trigger!r} in {part!r} "
                                 "(step=<N>, msg=<N>, start, token=<id>)")
            if trig != "start":
                at = int(num)
        specs.append(FaultSpec(role, kind, slow_ms, trig, at, every))
    return specs


class FaultInjector:
    """The faults that apply to one role; call its hooks at the points they name."""

    def __init__(self, role: str, specs: list[FaultSpec], incarnation: int = 0):
        self.role = role
        self.specs = [s for s in specs if s.role == role
                      and (incarnation == 0 or s.every_incarnation)]
        self.messages = 0
        self._fired: set[int] = set()

    def __bool__(self) -> bool:
        return bool(self.specs)

    def started(self) -> None:
        for s in self.specs:
            if s.trigger == "start":
                self._fire(s, "start")

    @property
    def wants_tokens(self) -> bool:
        """Whether a caller should pass the prompt tokens of what it handles (token=<id>)."""
        return any(s.trigger == "token" for s in self.specs)

    def on_message(self, step: int | None = None, token_ids=()) -> None:
        """Before handling a message (a plan for workers, a step for the scheduler);
        `token_ids`: the prompt tokens the message sends, when `wants_tokens`."""
        if not self.specs:
            return
        self.messages += 1
        for i, s in enumerate(self.specs):
            if s.kind == "slow":
                time.sleep(s.slow_ms / 1000.0)
            elif i not in self._fired and (
                    s.trigger == "" or (s.trigger == "msg" and self.messages >= s.at)
                    or (s.trigger == "step" and step is not None and step >= s.at)
                    or (s.trigger == "token" and s.at in token_ids)):
                self._fired.add(i)
                self._fire(s, f"message {self.messages}" if step is None else f"step {step}")

    def on_tokens(self, token_ids) -> None:
        """Before working on a request whose prompt is `token_ids` (token=<id> triggers only)."""
        for i, s in enumerate(self.specs):
            if s.trigger == "token" and i not in self._fired and s.at in token_ids:
                self._fired.add(i)
                self._fire(s, f"a request holding token {s.at}")

    def _fire(self, spec: FaultSpec, where: str) -> None:
        if spec.kind == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        if spec.kind == "abort":
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file left behind
            os.kill(os.getpid(), signal.SIGABRT)
        if spec.kind == "raise":
            raise FaultInjected(f"injected fault in {self.role} at {where}")
        if spec.kind == "hang":
            while True:
                time.sleep(3600)
