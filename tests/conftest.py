import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
os.environ.setdefault("TQ_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Each area's fixtures and helpers, in a module of its own: the Megatron trainer in this process, the embedded
# engine, whole runs.
pytest_plugins = ["megatron_fixtures", "engine_fixtures", "run_fixtures"]


def relax_cli(*args: str, env: dict | None = None, timeout: float = 120):
    """Run `python -m relax.entrypoints.train ARGS` and return the CompletedProcess."""
    import subprocess

    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "relax.entrypoints.train", *args], capture_output=True,
                          text=True, timeout=timeout, env=full_env, cwd=str(ROOT))


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"input": "1+1=", "label": "2"}\n{"input": "2+2=", "label": "4"}\n')
    return str(path)


# One local Ray cluster for every test that runs roles in this process: a start costs 5-13 s on 2 cores, and
# ~25 tests used to start their own. A Controller reuses a running Ray (and leaves it running); tests check
# instead that its shutdown gave back every resource (`assert_ray_released`). Subprocess runs (`relax_cli`)
# start their own cluster as users' runs do.
SHARED_RAY_CPUS = 32


def shared_ray():
    """The session's Ray (started on first use with the workers' environment and the run's engine key)."""
    import ray

    from relax.core.ray_cluster import job_env_vars, start_local_head

    if not ray.is_initialized():
        # Hooks that tests name by module (`test_rollout_e2e.mark`) are imported inside the roles: the workers
        # need this folder on their path (a test's own PYTHONPATH comes too late for a cluster started earlier).
        path = os.pathsep.join([str(ROOT / "tests"), str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        # as the run's (relax.core.ray_cluster): the workers inherit the environment, no prestarted idle workers
        start_local_head({**job_env_vars(), "PYTHONPATH": path},
                         num_cpus=SHARED_RAY_CPUS, include_dashboard=False, log_to_driver=False,
                         _system_config={"prestart_worker_first_driver": False})
    return ray


@pytest.fixture
def ray_session():
    return shared_ray()


def pytest_sessionfinish(session, exitstatus):
    import shutil

    import ray

    if ray.is_initialized():
        ray.shutdown()
    for path in _TINY_MODELS.values():
        shutil.rmtree(path.parent, ignore_errors=True)


def assert_ray_released(timeout_s: float = 30.0) -> None:
    """Everything a Controller (or a test) took from the shared cluster is given back: actors killed and
    placement groups removed, so every CPU is free again."""
    import time

    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        free = ray.available_resources().get("CPU", 0.0)
        if free >= ray.cluster_resources().get("CPU", 0.0):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the shared Ray cluster still has {ray.cluster_resources()['CPU'] - free:g} CPU(s) "
                                 "held after shutdown (an actor or placement group was left behind)")
        time.sleep(0.2)


_TINY_MODELS: dict = {}


def shared_tiny_model():
    """The tests' tiny model (qwen2-shaped, random init seed 0, byte-level tokenizer), built once per session in
    a temporary folder. Read-only: a test that changes a model builds its own."""
    import tempfile

    from relax.models.tiny import TinyArch, build_tiny_model_dir

    if "qwen2" not in _TINY_MODELS:
        folder = Path(tempfile.mkdtemp(prefix="relax-tests-tiny-"))
        _TINY_MODELS["qwen2"] = build_tiny_model_dir(folder / "model", TinyArch(family="qwen2"), seed=0)
    return _TINY_MODELS["qwen2"]


@pytest.fixture
def tiny_model():
    return str(shared_tiny_model())


@pytest.fixture(scope="module")
def model_dir(request, tmp_path_factory):
    """The test module's model folder: the session's tiny model (read-only), or, where the module sets
    `RANDOM_MODEL` (keyword arguments of relax.backends.megatron.testing.build_random_tiny_model: seed, sizes),
    a random qwen2 model of its own, built once for the module."""
    spec = getattr(request.module, "RANDOM_MODEL", None)
    if spec is None:
        return str(shared_tiny_model())
    from relax.backends.megatron.testing import build_random_tiny_model

    return build_random_tiny_model(tmp_path_factory.mktemp("m") / "qwen2", "qwen2", **spec)


def run_steps(config, after_start=None) -> list[dict]:
    """Start a Controller for `config`, run all its steps, shut it down (also on failure), and return the
    records of `<output-dir>/metrics.jsonl`. `after_start(controller)` runs between start and run."""
    import json

    from relax.core.controller import Controller

    shared_ray()
    controller = Controller(config)
    try:
        controller.start()
        if after_start is not None:
            after_start(controller)
        controller.run()
    finally:
        controller.shutdown()
    assert_ray_released()
    path = Path(config.output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]
