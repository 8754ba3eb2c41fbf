"""Flags of serving-side roles: the GenRM and the Relax router (--use-slime-router) whose features are built (see relax.config.support). Add a dest only with its code and
test, naming both in a comment beside it."""

SERVING_FEATURES: frozenset[str] = frozenset({
    # Relax's router instead of sglang-router (relax/backends/relax_router/server.py, process.py; chosen in
    # relax/roles/rollout.py): tests/test_relax_router.py (routing, threshold, deadline, process) and
    # tests/test_relax_router_e2e.py (a run through it)
    "use_slime_router",
    # the chain of middlewares (relax/config/middleware_paths.py, loaded before Ray by
    # relax/config/rules_rollout.py check_router): tests/test_relax_router.py test_middleware_chain_runs_in_order,
    # test_bad_middleware_paths_fail_naming_the_flag; the radix-tree token cache: test_relax_router_e2e.py
    "slime_router_middleware_paths",
    # the deadline of one engine request (server.py RelaxRouter.forward): test_request_deadline_answers_504_...
    "slime_router_timeout",
    # the size of the router's connection pool to the engines (server.py RelaxRouter.open): test_relax_router_e2e.py
    "slime_router_max_connections",
    # a worker failing N health checks / requests in a row is removed (server.py RelaxRouter.failed):
    # test_failure_threshold_removes_a_failing_worker
    "slime_router_health_check_failure_threshold",
    # the GenRM (relax/roles/genrm.py: engines and router started by relax/roles/rollout.py,
    # never push targets; relax/rollout/rewards/genrm.py: the judge the reward runner calls for reward type
    # genrm): tests/test_genrm_e2e.py (a run judged by the tiny model on its own engine, with a custom parser, its
    # sampling and engine options) and tests/test_genrm.py (default parser and template, hooks by dotted path,
    # --reward-error-policy on unparseable verdicts, the checks before Ray)
    "genrm_model_path", "genrm_engine_config", "genrm_sampling_config", "genrm_template_path", "genrm_parser_path",
    # the GenRM engines' count (relax/roles/genrm.py genrm_num_engines; tests/test_genrm.py
    # test_genrm_engine_count); per-engine GPUs reach the engines as --rollout-num-gpus-per-engine does (not run
    # on a GPU here)
    "genrm_num_gpus", "genrm_num_gpus_per_engine",
})
