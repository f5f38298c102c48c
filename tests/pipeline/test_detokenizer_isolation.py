"""Issue 38: an exception while the detokenizer works on one request fails that request alone
(its client hears the cause, the scheduler aborts it); the others' deltas go out as before."""
from __future__ import annotations

from pagedserve.breadcrumb import Breadcrumb, read_breadcrumb
from pagedserve.pipeline import messages
from pagedserve.pipeline.detokenizer.service import DetokenizerService
from pagedserve.pipeline.sampling_params import SamplingParams
from test_detokenizer_core import ids_of, tokenizer


class _Exploding:
    """A core that raises on one request's tokens (a bug no test foresaw)."""

    def __init__(self, core, bad: str) -> None:
        self.core, self.bad = core, bad

    def __getattr__(self, name):
        return getattr(self.core, name)

    def feed(self, key, *args, **kwargs):
        if key.startswith(self.bad):
            raise ZeroDivisionError("a bug")
        return self.core.feed(key, *args, **kwargs)


def test_an_exception_on_one_request_fails_it_alone(tmp_path):
    to_client, to_sched = [], []
    detok = DetokenizerService(tokenizer(), lambda c, m: to_client.append((c, m)),
                               to_sched.append, breadcrumb=Breadcrumb(str(tmp_path / "d")))
    detok.core = _Exploding(detok.core, "bad")
    params = SamplingParams(max_tokens=8)
    for rid in ("good", "bad"):
        detok.open(messages.DetokOpen(request_id=rid, client_id=b"c", prompt_token_ids=[1],
                                      sampling=params))
    ids = ids_of("hello world")
    detok.on_tokens(messages.TokenBatch(1, [
        messages.SampleTokens(request_id=rid, index=0, token_ids=ids, offset=0)
        for rid in ("bad", "good")]))
    failed = [m for _, m in to_client if isinstance(m, messages.RequestFailed)]
    assert [(m.request_id, m.status) for m in failed] == [("bad", 500)]
    assert "ZeroDivisionError: a bug" in failed[0].message
    assert to_sched == [messages.Abort(["bad"])]
    deltas = [d for _, m in to_client if isinstance(m, messages.DeltaBatch) for d in m.deltas]
    assert [d.request_id for d in deltas] == ["good"] and deltas[0].text == "hello world"
    assert "bad" not in detok.owners and read_breadcrumb(str(tmp_path / "d")) is None
