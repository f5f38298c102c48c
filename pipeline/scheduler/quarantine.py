"""Poison-request quarantine (docs/ARCHITECTURE.md, "Poison requests"): every request of a step
that crashed the workers is a suspect until it samples again; one suspect at a time (the one "on
trial") joins a step, and one in MAX_CRASHES such steps in a row is failed alone."""
from __future__ import annotations

from collections.abc import Iterable

from pagedserve.pipeline.scheduler.sequence import RequestState

MAX_CRASHES = 2  # steps a request may crash the worker group in before it is failed alone


class Quarantine:
    def __init__(self) -> None:
        self.suspects: dict[str, RequestState] = {}
        self.on_trial: RequestState | None = None

    def record_crash(self, requests: Iterable[RequestState]) -> list[RequestState]:
        """Count a crash against each of the lost step's requests (each once); the ones at
        MAX_CRASHES are returned (to be failed), the others become suspects."""
        self.on_trial = None  # its trial ended with the step
        culprits = []
        for req in {req.request_id: req for req in requests}.values():
            req.crashes += 1
            if req.crashes >= MAX_CRASHES:
                culprits.append(req)
                self.suspects.pop(req.request_id, None)
            else:
                self.suspects[req.request_id] = req
        return culprits

    def holds_back(self, req: RequestState) -> bool:
        """A suspect waits while another suspect is on trial (one test while nobody is on
        trial, the common case)."""
        trial = self.on_trial
        return trial is not None and trial is not req and req.request_id in self.suspects

    def begin_trial(self, req: RequestState) -> None:
        """`req` joins a step: a suspect joining is the one on trial."""
        if req.request_id in self.suspects:
            self.on_trial = req

    def end_trial(self, step_id: int) -> None:
        """After step `step_id`, which did not crash: the suspect on trial is cleared once one of
        its sequences sampled in it (caught up: a long recompute takes several steps)."""
        req = self.on_trial
        if req is None or not any(
                seq.last_step == step_id and (len(seq.token_ids) == seq.num_computed_tokens + 1
                                              or seq.embedding is not None)
                for seq in req.seqs):
            return
        req.crashes = 0
        self.suspects.pop(req.request_id, None)
        self.on_trial = None

    def forget(self, req: RequestState) -> None:
        """`req` finished: it is no longer a suspect, nor on trial."""
        self.suspects.pop(req.request_id, None)
        if self.on_trial is req:  # (on trial implies a suspect)
            self.on_trial = None
