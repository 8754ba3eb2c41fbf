"""Fault tolerance and elastic scaling flags."""


def add_flags(parser):
    g = parser.add_argument_group("Fault tolerance")
    g.add_argument("--use-fault-tolerance", action="store_true", default=False,
                   help="Detect dead rollout engines, route around them and restart them.")
    g.add_argument("--use-health-check", action="store_true", default=False,
                   help="Run the HealthManager: watch every role and restart failed ones.")
    g.add_argument("--max-global-restart", type=int, default=3, help="Global restarts allowed before the run stops.")
    g.add_argument("--rollout-health-check-interval", type=float, default=30.0, help="Seconds between engine health probes.")
    g.add_argument("--rollout-health-check-timeout", type=float, default=30.0, help="Seconds before a health probe fails.")
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
