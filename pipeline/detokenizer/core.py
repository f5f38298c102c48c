"""The detokenizer's pure logic for many requests: token ids in, text deltas out.

The detokenizer process is glue around this: it opens a request when the scheduler first
forwards its tokens, turns each `Delta` into a `TextDelta` for the owning client, sends
`StopMatched` to the scheduler when `Delta.stop_matched` ended a request the scheduler still
runs, and closes the request once it is finished or aborted.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from pagedserve.pipeline.detokenizer.incremental import IncrementalDetokenizer, special_token_ids
from pagedserve.pipeline.sampling_params import SamplingParams
from pagedserve.pipeline.detokenizer.stop_strings import StopStringMatcher


@dataclass(slots=True)
class Delta:
    request_id: str
    text: str                      # new text for the client (stop string trimmed)
    token_ids: list[int]           # the ids this delta covers
    finished: bool
    finish_reason: str | None      # "stop", "length", "abort", ... once finished
    stop_matched: str | None = None   # the stop string that ended the request (its stop_reason)
    num_output_tokens: int = 0        # output ids fed for the request so far (usage accounting)


@dataclass(slots=True)
class _Request:
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher
    min_tokens: int
    text_to_skip: int              # characters the client already has (resume)
    tokens_to_skip: int            # token ids the client already has (resume)
    num_output_tokens: int = 0
    finished: bool = False
    chunks: list[str] = field(default_factory=list)


class DetokenizerCore:
    """Per-request incremental detokenization and stop-string matching, with no I/O."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._special_ids = special_token_ids(tokenizer)
        self._requests: dict[str, _Request] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def open(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
             text_offset: int = 0, token_offset: int = 0) -> None:
        """Starts a request. To resume after a restart, open it with the number of characters
        (and token ids) the client already received and re-feed all its output ids: only what
        lies beyond the offsets is emitted."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already open in the detokenizer")
        if text_offset < 0 or token_offset < 0:
            raise ValueError(f"offsets must be >= 0, got text_offset={text_offset}, "
                             f"token_offset={token_offset}")
        self._requests[request_id] = _Request(
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens,
                special_ids=self._special_ids),
            stop_matcher=StopStringMatcher(params.stop, params.include_stop_str_in_output),
            min_tokens=params.min_tokens, text_to_skip=text_offset, tokens_to_skip=token_offset)

    def feed(self, request_id: str, token_ids: Sequence[int], finished: bool = False,
             finish_reason: str | None = None) -> Delta | None:
        """Adds a request's new output ids. Returns None when there is nothing to say: the
        request is unknown (closed or aborted) or already finished (tokens that raced a stop
        string match are ignored)."""
        req = self._requests.get(request_id)
        if req is None or req.finished:
            return None
        req.chunks.clear()
        consumed = self._detokenize(req, token_ids)
        if finished and not req.stop_matcher.finished:
            self._add_text(req, req.detokenizer.flush(), can_stop=True)
            req.chunks.append(req.stop_matcher.flush())
        stop = req.stop_matcher.matched
        if stop is not None:
            req.finished, finish_reason = True, "stop"
        elif finished:
            req.finished = True
        return Delta(request_id, self._client_text(req),
                     self._client_ids(req, token_ids[:consumed]), req.finished,
                     finish_reason if req.finished else None, stop, req.num_output_tokens)

    def close(self, request_id: str) -> None:
        """Forgets a request (finished or aborted); closing an unknown id is a no-op."""
        self._requests.pop(request_id, None)

    def _detokenize(self, req: _Request, token_ids: Sequence[int]) -> int:
        """Feeds the ids through detokenizer and stop matcher; returns how many were used.

        With stop strings, ids go one at a time so that the ids after the one that completed a
        stop string are dropped, and so that stops count only once min_tokens ids are out."""
        if not req.stop_matcher.stops:
            req.chunks.append(req.detokenizer.add(token_ids))
            req.num_output_tokens += len(token_ids)
            return len(token_ids)
        for i, token_id in enumerate(token_ids):
            req.num_output_tokens += 1
            can_stop = req.num_output_tokens >= req.min_tokens
            self._add_text(req, req.detokenizer.add((token_id,)), can_stop=can_stop)
            if req.stop_matcher.finished:
                return i + 1
        return len(token_ids)

    def _add_text(self, req: _Request, text: str, *, can_stop: bool) -> None:
        if not text:
            return
        emitted, _ = req.stop_matcher.feed(text, can_stop=can_stop)
        if emitted:
            req.chunks.append(emitted)

    @staticmethod
    def _client_text(req: _Request) -> str:
        text = "".join(req.chunks)
        if req.text_to_skip:
            skipped = min(req.text_to_skip, len(text))
            req.text_to_skip -= skipped
            text = text[skipped:]
        return text

    @staticmethod
    def _client_ids(req: _Request, token_ids: Sequence[int]) -> list[int]:
        if req.tokens_to_skip:
            skipped = min(req.tokens_to_skip, len(token_ids))
            req.tokens_to_skip -= skipped
            return list(token_ids[skipped:])
        return list(token_ids)
