import pytest

from pagedserve.faults import FaultInjected, FaultInjector, parse


def test_parse_kinds_and_triggers():
    specs = parse("worker1:crash@step=40; detokenizer:slow=50;scheduler:raise@msg=3;worker0:hang@start!")
    assert [(s.role, s.kind, s.trigger, s.at, s.every_incarnation) for s in specs] == [
        ("worker1", "crash", "step", 40, False), ("detokenizer", "slow", "", 0, False),
        ("scheduler", "raise", "msg", 3, False), ("worker0", "hang", "start", 0, True)]
    assert specs[1].slow_ms == 50


@pytest.mark.parametrize("bad, cause", [("worker0", "<role>:<kind>"), ("worker0:explode", "unknown fault kind"),
                                        ("worker0:crash@when=3", "unknown trigger"), ("detokenizer:slow=0", "positive")])
def test_bad_specs_name_the_cause(bad, cause):
    with pytest.raises(ValueError, match=cause):
        parse(bad)


def test_raise_fires_once_at_first_step_at_or_after_trigger():
    inj = FaultInjector("scheduler", parse("scheduler:raise@step=5"))
    inj.on_message(step=3)
    with pytest.raises(FaultInjected, match="step 6"):
        inj.on_message(step=6)
    inj.on_message(step=7)  # fired already


def test_faults_apply_to_their_role_and_first_incarnation_only():
    specs = parse("worker1:raise@msg=1;worker0:raise@msg=1!")
    assert not FaultInjector("worker0x", specs)
    assert not FaultInjector("worker1", specs, incarnation=1)
    with pytest.raises(FaultInjected):
        FaultInjector("worker0", specs, incarnation=2).on_message()


def test_a_token_trigger_fires_on_the_plan_that_sends_that_prompt_token():
    from pagedserve.faults import FaultInjected, FaultInjector, parse
    inj = FaultInjector("worker0", parse("worker0:raise@token=1234!"), incarnation=2)
    assert inj.wants_tokens
    inj.on_message(step=1, token_ids={5, 6})
    with pytest.raises(FaultInjected, match="worker0 at step 2"):
        inj.on_message(step=2, token_ids={5, 1234})
    inj.on_message(step=3, token_ids={1234})  # fired once per incarnation
