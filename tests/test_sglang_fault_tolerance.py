"""--use-fault-tolerance with real SGLang engines on CPU (`--rollout-backend sglang`): the embedded-engine kill of
tests/test_engine_fault_tolerance.py again, through its own run and checks. Two SGLang engines behind sglang-router
(plus the trainer, on 2 cores); engine 1 is killed (SIGKILL, the test-only fault injection) while it holds requests
of step 1. The run finishes; every sample of every step is there exactly once; the killed engine was found,
replaced, and its replacement was sent the last push's weights: at the end both engines report the last version
and give the same greedy log-probs.

Runs only where the SGLang venv exists (tests/test_sglang_cpu.py: `SGLANG_PY`), else skips with the install hint.
"""

import pytest

from test_engine_fault_tolerance import assets  # noqa: F401  (the runs' model and data, a fixture)
from test_engine_fault_tolerance import check_killed_engine_replaced, check_samples, make_config, run_with_faults
from test_sglang_cpu import SGLANG_PY, SKIP_MSG, sglang_ray  # noqa: F401  (sglang_ray: a fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(SGLANG_PY is None, reason=SKIP_MSG)]

# SGLang answers /health_generate once its scheduler reaches the probe, behind the running batch: on 2 loaded cores
# that can pass the embedded test's 3 s, and a healthy engine would be replaced. A killed one refuses at once.
PROBE_TIMEOUT_S = 20


def test_killed_sglang_engine_is_replaced_and_loses_no_sample(assets, sglang_ray):  # noqa: F811
    # 3 steps: the failure may be counted in the step after the fault's (check_killed_engine_replaced)
    config = make_config(assets, "sglang-kill", 3, "--rollout-backend", "sglang",
                         "--rollout-health-check-timeout", str(PROBE_TIMEOUT_S))
    assert config.rollout_backend == "sglang" and config.rollout_health_check_timeout == PROBE_TIMEOUT_S
    records, events, versions = run_with_faults(config, ["kill:engine=1:step=1"], add_engine=False)
    assert len(records) == 3
    check_samples(config, records)  # the killed engine's requests were sent again: every sample once
    engine_kill, failed, replaced, fault = check_killed_engine_replaced(events, records, step=1)
    # the last push (version 3) reached the replacement, which is one of the two engines of the end
    assert replaced["url"] in versions and set(versions.values()) == {"3"}, versions
    print(f"sglang: resends {fault['rollout/failover_resends']:g}, detected after "
          f"{failed['time'] - engine_kill['time']:.2f} s, replaced {replaced['time'] - failed['time']:.2f} s later")
