"""Sample accounting identities (relax.observability.accounting): a broken identity is reported by name."""

from relax.observability.accounting import (
    RunAccounting,
    delivery_accounting,
    rollout_accounting,
    step_problems,
)


def step(generated=12, kept=8, filtered=None, surplus=2, in_flight=2, to_train=8, trained=8):
    m = rollout_accounting(generated=generated, kept=kept, filtered=filtered or {"zero_std": 2},
                           returned_surplus=surplus, returned_in_flight=in_flight)
    m.update(delivery_accounting(kept=kept, to_train=to_train))
    m["samples/trained"] = float(trained)
    return m


def test_a_consistent_step_has_no_problem_and_totals_add_up(tmp_path):
    run = RunAccounting()
    for _ in range(3):
        m = step()
        assert step_problems(m, trained_expected=True) == []
        run.add(m)
    run.add(step(kept=8, to_train=6, trained=6))  # the postprocess hook dropped 2
    assert run.totals["generated"] == 48 and run.totals["trained"] == 30 and run.totals["dropped/postprocess"] == 2
    line = run.summary_line()
    assert "48 generated" in line and "30 trained" in line and "postprocess 2" in line
    assert '"generated": 48' in run.write(tmp_path).read_text()


def test_each_broken_identity_is_named():
    assert step_problems(step(generated=13), trained_expected=True) == [
        "generated 13 != kept 8 + filtered 2 + returned 2"]
    assert step_problems(step(trained=7), trained_expected=True) == ["trained 7 != to_train 8"]
    assert step_problems(step(trained=0), trained_expected=False) == []  # a step that does not train
    m = step()
    m["samples/to_train"] = 9.0
    assert step_problems(m, trained_expected=True) == ["to_train 9 != kept 8 - dropped 0 + added 0",
                                                       "trained 8 != to_train 9"]
