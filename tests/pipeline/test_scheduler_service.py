"""SchedulerService: what it does with each message, through its dispatch table."""
from __future__ import annotations

from pagedserve import transport
from pagedserve.pipeline import messages
from pagedserve.pipeline.sampling_params import SamplingParams
from pagedserve.pipeline.scheduler.service import SchedulerService
from sched_fakes import make_scheduler


def service():
    sched, _ = make_scheduler(64, block_size=4, max_num_seqs=4)
    to_detok = []
    svc = SchedulerService(sched, send_to_client=lambda c, m: None,
                           send_to_detok=to_detok.append, clock=lambda: 0.0)
    return sched, svc, transport.Dispatcher("scheduler", svc.handlers()), to_detok


def add(dispatch, rid: str, client: bytes) -> None:
    dispatch.dispatch(messages.AddRequest(request_id=rid, prompt_token_ids=[1, 2, 3],
                                          sampling=SamplingParams(max_tokens=5),
                                          arrival_time=0.0), client)


def test_a_client_aborts_only_its_own_requests():
    sched, svc, dispatch, _ = service()
    add(dispatch, "mine", b"alice")
    add(dispatch, "theirs", b"bob")
    dispatch.dispatch(messages.Abort(["theirs", "mine", "nobody"]), b"alice")
    assert set(sched.requests) == {"theirs"}
    assert svc.stats()["foreign_aborts"] == 2
    dispatch.dispatch(messages.Abort(["theirs"]), None)  # the detokenizer's (client gone)
    assert not sched.requests


def test_failed_requests_are_told_through_the_detokenizer_and_forgotten():
    sched, svc, dispatch, to_detok = service()
    add(dispatch, "poison", b"alice")
    sched.abort("poison")
    svc.fail_requests([("poison", "it crashed the workers twice")])
    assert isinstance(to_detok[-1], messages.RequestFailed)
    assert (to_detok[-1].request_id, to_detok[-1].status) == ("poison", 500)
    assert "poison" not in svc.owners
    svc.fail_requests([("poison", "again")])  # once only
    assert sum(isinstance(m, messages.RequestFailed) for m in to_detok) == 1


def test_restarts_and_unknown_messages_are_counted_in_stats():
    _, svc, dispatch, _ = service()
    svc.count_restart("worker")
    dispatch.dispatch(messages.UnknownMessage("detokenizer", "Bogus", "no handler"), None)
    stats = svc.stats()
    assert stats["restarts"] == {"worker": 1}
    assert stats["unknown_messages"] == [{"role": "detokenizer", "type": "Bogus", "count": 1}]


def test_a_request_that_finished_while_the_detokenizer_was_down_is_refed():
    """Its last tokens went to a dead detokenizer: the successor gets them all again, or the
    client would wait forever (found by the chaos soak: short requests finishing while a
    killed detokenizer restarted)."""
    sched, worker = make_scheduler(64, block_size=4, max_num_seqs=4, report_finished=True)
    to_detok = []
    svc = SchedulerService(sched, send_to_client=lambda c, m: None,
                           send_to_detok=to_detok.append, clock=lambda: 0.0)
    dispatch = transport.Dispatcher("scheduler", svc.handlers())
    add(dispatch, "short", b"alice")
    svc.roles_down["detokenizer"] = "was killed by SIGKILL"  # the launcher's RoleDown
    while sched.has_unfinished():
        plan = sched.schedule(0.0)
        svc.on_step_result(plan, worker.execute(plan))
    to_detok.clear()  # all of that went to the dead detokenizer
    svc.on_role_restarted("detokenizer")
    opened = [m for m in to_detok if isinstance(m, messages.DetokOpen)]
    fed = [s for m in to_detok if isinstance(m, messages.TokenBatch) for s in m.all_samples()]
    assert [m.request_id for m in opened] == ["short"]
    assert [(s.request_id, len(s.token_ids), s.finish_reason) for s in fed] == [("short", 5, "length")]


def test_a_resubmission_of_a_request_held_from_that_client_is_ignored():
    """A client whose socket may have reconnected to a restarted scheduler sends what is in
    flight again, flagged: the scheduler that has it ignores it; a fresh duplicate, or another
    client's id, is still refused."""
    sched, svc, dispatch, to_detok = service()
    rejected = []
    svc.send_to_client = lambda client, msg: rejected.append((client, msg))
    add(dispatch, "r1", b"alice")
    opened = len(to_detok)
    again = messages.AddRequest(request_id="r1", prompt_token_ids=[1, 2, 3],
                                sampling=SamplingParams(max_tokens=5), arrival_time=0.0,
                                resubmitted=True)
    dispatch.dispatch(again, b"alice")
    assert (list(sched.requests), len(to_detok), rejected) == (["r1"], opened, [])
    dispatch.dispatch(again, b"bob")
    add(dispatch, "r1", b"alice")
    assert [(c, m.status) for c, m in rejected] == [(b"bob", 400), (b"alice", 400)]
    assert all("already in flight" in m.message for _, m in rejected)
