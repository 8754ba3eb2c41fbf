"""Fault tolerance and elastic scaling flags."""

import argparse


def seconds(value: str) -> float:
    """A duration in seconds, >= 0 (0: off)."""
    try:
        out = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (a number >= 0), got {value!r}") from None
    if not out >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected seconds >= 0 (0 switches it off), got {value!r}")
    return out


def add_flags(parser):
    g = parser.add_argument_group("Fault tolerance")
    g.add_argument("--use-fault-tolerance", action="store_true", default=False,
                   help="Detect dead rollout engines, route around them and restart them; with --rm-type remote_rm "
                        "also watch the reward server at --rm-url (its /health, on the probe flags below): while it "
                        "does not answer, its reward requests are held and sent again once it does, at most "
                        "--reward-timeout seconds, after which the run stops naming it.")
    g.add_argument("--use-health-check", action="store_true", default=False,
                   help="Run the HealthManager: heartbeats of every Megatron rank and of the rollout manager, and "
                        "on a failure a restart of the run from its last checkpoint (at most --max-global-restart "
                        "times; from step 0 without one).")
    g.add_argument("--max-global-restart", type=int, default=3,
                   help="With --use-health-check: restarts of the run (every role, from the last checkpoint) allowed "
                        "before it stops, naming what failed and how often.")
    # Relax's own: the heartbeats of every Megatron rank and the rollout manager (relax.core.health) that tell a
    # hung worker from a dead one. Checked before Ray (relax.config.rules_training.check_health).
    g.add_argument("--heartbeat-interval", type=float, default=1.0,
                   help="With --use-health-check: seconds between two heartbeats of each trainer, reference, teacher "
                        "and critic rank and of the rollout manager (sent from a thread of its own); > 0.")
    g.add_argument("--heartbeat-timeout", type=float, default=30.0,
                   help="With --use-health-check: a rank or the rollout manager without a heartbeat for this many "
                        "seconds is failed (a stopped or dead process), naming its role, rank, pid and the step; "
                        "at least twice --heartbeat-interval.")
    g.add_argument("--rollout-health-check-interval", type=float, default=30.0, help="Seconds between engine health probes (and reward server probes).")
    g.add_argument("--rollout-health-check-timeout", type=float, default=30.0, help="Seconds before a health probe (of an engine or the reward server) fails.")
    g.add_argument("--rollout-health-check-first-wait", type=float, default=0,
                   help="Seconds to wait before the first probe (raise for slow kernel warm-up).")

    g = parser.add_argument_group("Autoscaler")
    g.add_argument("--autoscaler-config", type=str, default=None, help="Autoscaler YAML; enables autoscaling of rollout engines.")
    g.add_argument("--scale-out-timeout", type=float, default=300.0,
                   help="Seconds allowed for a scale-out (start, health check, weight sync).")
    g.add_argument("--scale-out-partial-success-policy", type=str, default="rollback_all",
                   choices=["rollback_all", "keep_partial"],
                   help="On a partly failed scale-out: undo all new engines, or keep those that came up.")
    g.add_argument("--scale-in-drain-timeout", type=float, default=30.0,
                   help="Seconds to let in-flight requests finish before aborting them on scale-in.")
    g.add_argument("--scale-in-shutdown-timeout", type=float, default=30.0,
                   help="Seconds for an engine to stop gracefully before it is killed.")

    # Relax's own flags: every call the run makes into an engine, the router, a storage unit or a trainer rank
    # has a deadline (relax.core.deadlines); a call past its deadline stops the run with one line naming the
    # component, its address and what it was doing. The reward deadline is --reward-timeout.
    g = parser.add_argument_group("Deadlines")
    g.add_argument("--generate-timeout", type=float, default=600.0,
                   help="Seconds one generation request (/generate through the router) may take. A request that "
                        "has not answered by then is tried again twice; the third miss stops the run, naming the "
                        "sample, the router and any engine that no longer answers its health check.")
    g.add_argument("--engine-liveness-timeout", type=seconds, default=60.0,
                   help="Seconds a rollout engine may answer neither its requests nor a /health_generate probe "
                        "(sent every few seconds while a rollout step or an evaluation has requests in flight) "
                        "before it is named on the console as stopped or hung; then, without "
                        "--use-fault-tolerance, the run stops (exit 1) naming the engine, its address and the step, "
                        "and with it the engine is replaced. Separate from --generate-timeout, which must allow the "
                        "longest generation. 0 switches the watch off.")
    g.add_argument("--weight-update-timeout", type=float, default=300.0,
                   help="Seconds each request of a weight push to an engine (one chunk of weights, the version "
                        "check) may take; past it the run stops naming the engine.")
    g.add_argument("--engine-control-timeout", type=float, default=60.0,
                   help="Seconds a control request may take: engine memory release/resume, health checks, the "
                        "driver's calls into the data plane's storage units; also, capped at 10 s, the time each "
                        "role gets to stop by itself at shutdown before it is killed.")
    g.add_argument("--train-step-timeout", type=float, default=3600.0,
                   help="Seconds one call into the trainer ranks (and reference/critic ranks) may take: a training "
                        "step, reference log-probs, the weight export and push, a checkpoint save. Past it the run "
                        "stops naming the ranks that have not answered. 0 waits without a deadline.")
