"""The autoscaler's reaction time to a burst of requests: scale-out detection, the new engine's way into service,
scale-in after the burst, and what the burst got out of the second engine.

    .venv/bin/python benchmarks/autoscaler_bench.py                  # built-in config (short windows): ~1-2 min
    .venv/bin/python benchmarks/autoscaler_bench.py --config my_autoscaler.yaml --rounds 3 --clients 16

What runs: a local Ray, the embedded default's tiny model (`build_embedded_assets`, as relax-train builds it),
the real sglang-router (`RouterProcess`, the rollout manager's default router), an `EnginePool` started with 1
embedded engine (`EngineActor`, 1 thread) and the product's `Autoscaler` on it, reading the engines' /metrics.
The one part not running is the trainer: `WeightSource` below stands in for trainer rank 0, which keeps the
weights of its last push and pushes them to a joining engine (`push_kept_weights`, here with the real
`relax.weights.sync.push_named_tensors`); the pool is at weight version "1" before the first round, so a new
engine joins only after it was given version 1 and reports it.

Each round: --clients threads post /generate (through the router; --max-new-tokens tokens each, EOS ignored) until
the scale-out has completed plus --after-out s, then nothing until the scale-in has stopped the added engine.
Measured (times from the pool's events, the new engine's record and the pool's state polled every 0.1 s; the
scaling's start is noted by `TimedAutoscaler` when the scaling call begins, which is the `time` of its row in
`decisions` too):

  detect    burst start -> scale-out decision: scale_out_policy.condition_duration_secs (every sample of that span
            must show the load; `_held` lets the span start one sampling interval late, so it can be a little
            less), plus the wait for the first loaded scrape (< metrics_interval_secs) and for the next
            evaluation (< evaluation_interval_secs).
  join      decision -> the new engine registered with the router at the pool's weight version: the engine's
            start from the checkpoint (start), the weight push from the source and the version check (sync), the
            router's add_worker, which waits until the router lists it healthy (router). Engine start dominates.
  idle      burst end (last answer of the burst) -> scale-in decision: scale_in_policy.condition_duration_secs of
            idle samples (low usage, no queue; the throughput is steady only once the burst's last non-zero
            samples left that span), but not before scale_in_cooldown_secs after the scale-out finished (not
            binding here: the burst goes on --after-out s), plus up to one evaluation interval.
  stop      scale-in decision -> engine stopped: off the router, its in-flight requests drained (none after the
            burst), then its server stopped (--scale-in-shutdown-timeout before a kill).
  tok/s     generated tokens/s the clients received, 1 engine (burst start -> decision) vs 2 engines (1 s after
            registration -> the last request sent); counted at the clients, so that the benchmark adds no reader
            of the engines' /metrics beside the autoscaler.

Measured on this machine (2 cores shared with other jobs, load average ~2 before the run), `--rounds 3`, built-in
config, 12 clients x 32 tokens (median, then per round; every request answered):

    burst start -> scale-out decision                       3.02 s   (4.29 3.02 2.98)
    decision -> new engine behind the router at version 1  13.64 s   (31.31 13.64 9.00)
      engine start + health                                13.50 s   (31.21 13.50 8.87)
      weight push + version check                           0.07 s
      router add_worker (until listed healthy)              0.06 s
    burst end -> scale-in decision                          4.60 s   (4.65 4.58 4.60)
    scale-in decision -> engine stopped                     0.23 s   (drain 0.07 s, server stop 0.14 s)
    generated tokens/s: 1 engine 1284, 2 engines 1256 (0.98x); 2167 requests sent, 2167 answered, 0 failed

Other runs (2 rounds, other jobs' tests running beside, load average 1.3-7): detect 3.05 / 3.22 / 3.20 s, join 19.4
/ 24.4 / 21.8 s, idle 4.65 / 4.81 / 4.76 s, stop 0.26 / 0.24 / 0.29 s, 0 failed. Detection and scale-in sit at their
config floors (3 s condition + < 1 s; 4 s idle + ~0.6 s). The join is the engine's start, and the first added engine
of a run starts slowest: without load, starts of a further engine measured 9.9 s, then 4.9 and 5.3 s (the actor
itself 1.4-2.2 s of it); under the burst, which keeps both cores busy, 2-3x that. The second engine brings no
throughput here (0.82-1.07x): with 1 thread per engine, 2 engines, the router and the 12 clients share 2 cores; with
a core (or accelerator) per engine the burst's tokens/s would scale. (The figures above were measured before a
scale-in asked the router only once and before --scale-out-timeout bounded a scale-out's wait; neither changes
what is timed here.)

The built-in config (written to the work folder as autoscaler.yaml; --config replaces it) has windows of
seconds instead of the product's defaults (30 s / 120 s conditions, 10 s metrics, 30 s evaluation, 60 s / 300 s
cooldowns), so that a round takes about half a minute. With the defaults, detection would take 20-70 s and
scale-in 120 s of idle, and not before 300 s after the scale-out; engine start and weight sync do not depend on
the config.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import ray  # noqa: E402
import requests  # noqa: E402
import yaml  # noqa: E402

from relax.rollout.autoscaler import Autoscaler  # noqa: E402

# scale out when more than 2 requests per engine wait for >= 3 s; scale in after 4 s idle (5 s cooldowns)
DEFAULT_CONFIG = {
    "min_engines": 1, "max_engines": 2, "scale_out_cooldown_secs": 5, "scale_in_cooldown_secs": 5,
    "metrics_interval_secs": 0.5, "evaluation_interval_secs": 1.0, "condition_window_secs": 10,
    "scale_out_policy": {"queue_depth_per_engine": 2, "condition_duration_secs": 3, "max_delta": 1},
    "scale_in_policy": {"token_usage_threshold": 0.05, "queue_depth_threshold": 0,
                        "throughput_variance_threshold": 0.5, "condition_duration_secs": 4, "max_delta": 1},
}
# max_running_requests 4: the burst's clients beyond 4 per engine queue, which is what the config reacts to
SERVER_ARGS = {"dtype": "float32", "random_seed": 0, "num_threads": 1, "max_running_requests": 4}
VERSION = "1"


@ray.remote(num_cpus=0)
class WeightSource:
    """Stands in for trainer rank 0: keeps the weights of the last push and pushes them to the engines named."""

    def __init__(self, model_dir: str, version: str):
        from safetensors.torch import load_file

        tensors = load_file(os.path.join(model_dir, "model.safetensors"))
        self.named = [(name, t + 0.01) for name, t in sorted(tensors.items())]  # "trained": not the checkpoint
        self.version = version

    def push_kept_weights(self, urls):
        from relax.weights.sync import push_named_tensors

        report = push_named_tensors(self.named, urls, self.version, 1 << 20, timeout_s=60)
        return {**report, "version": self.version}


class TimedAutoscaler(Autoscaler):
    """Notes when each scaling began (its row in `decisions` may be written only once it has finished)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.began: list[tuple[str, float]] = []  # (action, wall-clock time the scaling began)

    def _scale_out(self, decision):
        self.began.append(("scale_out", time.time()))
        return super()._scale_out(decision)

    def _scale_in(self, decision):
        self.began.append(("scale_in", time.time()))
        return super()._scale_in(decision)


class Burst:
    """Client threads posting /generate to the router as fast as they are answered, until `stop`."""

    def __init__(self, url: str, clients: int, max_new_tokens: int):
        from relax.wire.auth import auth_headers

        self.url, self.headers = url + "/generate", auth_headers()
        self.body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": max_new_tokens,
                                                                 "ignore_eos": True}}
        self.answers: list[tuple[float, int]] = []  # (time answered, completion tokens)
        self.sent = self.failed = 0
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]

    def start(self) -> "Burst":
        self.started = time.time()
        for t in self.threads:
            t.start()
        return self

    def _client(self) -> None:
        session = requests.Session()
        while not self.stop.is_set():
            with self.lock:
                self.sent += 1
            try:
                r = session.post(self.url, json=self.body, headers=self.headers, timeout=120)
                ok = r.status_code == 200
                tokens = r.json()["meta_info"]["completion_tokens"] if ok else 0
                why = f"HTTP {r.status_code}: {r.text[:200]}"
            except Exception as exc:  # a lost connection counts as a failed request
                ok, tokens, why = False, 0, repr(exc)[:200]
            with self.lock:
                if ok:
                    self.answers.append((time.time(), tokens))
                else:
                    self.failed += 1
                    self.errors.append(why)

    def finish(self) -> float:
        """Stop sending, wait for the requests in flight; the time the last one was answered."""
        self.stopped = time.time()
        self.stop.set()
        for t in self.threads:
            t.join(150)
        return max([t for t, _ in self.answers], default=time.time())

    def tokens_per_s(self, t0: float, t1: float) -> float:
        return sum(n for t, n in self.answers if t0 <= t < t1) / (t1 - t0) if t1 > t0 else float("nan")


class StatePoller:
    """Polls the pool every 0.1 s: when each engine (by id) was first seen in each state (the states between the
    pool's events: a new engine's server answered once it is `syncing`; a drained one is `stopped` before its
    server stops)."""

    def __init__(self, pool):
        self.pool, self.seen = pool, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            now = time.time()
            for e in self.pool.list():
                self.seen.setdefault((e["id"], e["state"]), now)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def wait_for(test, timeout_s: float, poll_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if test():
            return True
        time.sleep(poll_s)
    return test()


def event(pool, kind: str, **match) -> dict | None:
    return next((e for e in pool.events if e["kind"] == kind and all(e.get(k) == v for k, v in match.items())), None)


def one_round(n: int, args, pool, scaler, router, poller) -> dict:
    from relax.wire.engine_client import EngineClient

    first = pool.urls()[0]
    out_before = sum(1 for a, _ in scaler.began if a == "scale_out")
    burst = Burst(router.url, args.clients, args.max_new_tokens).start()
    r = {"round": n, "ok": False}
    try:
        if not wait_for(lambda: len(pool.urls()) >= 2, args.burst_timeout):
            r["why"] = f"no scale-out within {args.burst_timeout:g} s of burst"
            return r
        added = next(u for u in pool.urls() if u != first)
        time.sleep(args.after_out)
    finally:
        burst_end = burst.finish()
    rec = pool.by_url(added)
    decided = [t for a, t in scaler.began if a == "scale_out"][out_before]
    synced = event(pool, "engine_synced", url=added)["time"]
    registered = event(pool, "engine_registered", url=added)["time"]
    syncing = min(poller.seen.get((rec.id, "syncing"), synced), synced)  # its server answered: started
    served = EngineClient(added, timeout_s=30).get_weight_version()
    in_router = added in router.worker_urls()
    r.update(detect=decided - burst.started, join=registered - decided, start=syncing - rec.started_at,
             sync=synced - syncing, router=registered - synced, served=served, in_router=in_router,
             tps1=burst.tokens_per_s(burst.started, decided), tps2=burst.tokens_per_s(registered + 1.0, burst.stopped),
             sent=burst.sent, answered=len(burst.answers), failed=burst.failed, errors=burst.errors[:3])
    print(f"round {n}: scale-out decided {r['detect']:.1f} s into the burst, {added} serving version {served} "
          f"{r['join']:.1f} s later; burst over ({burst.sent} sent, {burst.failed} failed)", flush=True)

    # back to the first engine (a config with max_engines > 2 may have added more than one; each leaves by its own
    # scale-in decision): the figures are those of the first scale-in after the burst and the engine it removed
    if not wait_for(lambda: len(pool.list()) == 1 and event(pool, "engine_removed", url=added), args.quiet_timeout):
        r["why"] = f"not back to 1 engine within {args.quiet_timeout:g} s after the burst"
        return r
    in_decided = next(t for a, t in scaler.began if a == "scale_in" and t > burst_end)
    gone = next(e for e in pool.events if e["kind"] == "engine_removed" and e["time"] > in_decided)
    removed = gone["time"]
    drained = min(poller.seen.get((gone["engine"], "stopped"), removed), removed)  # off the router and drained
    r.update(idle=in_decided - burst_end, stop=removed - in_decided, drain=drained - in_decided, halt=removed - drained,
             left_router=added not in router.worker_urls())
    r["ok"] = (r["failed"] == 0 and r["served"] == VERSION and in_router and r["left_router"]
               and pool.urls() == [first])
    if not r["ok"]:
        r["why"] = (f"failed requests {burst.errors[:3]}" if r["failed"] else
                    f"added engine served {served!r} (want {VERSION}), in router {in_router}, left "
                    f"{r['left_router']}, engines now {pool.urls()}")
    print(f"round {n}: scale-in decided {r['idle']:.1f} s after the burst, engine stopped {r['stop']:.1f} s later",
          flush=True)
    return r


def report(results: list[dict]) -> None:
    def med(key):
        return statistics.median(r[key] for r in results)

    rows = [("detect", "burst start -> scale-out decision"),
            ("join", "decision -> new engine behind the router at the current version"),
            ("start", "  of which: engine start + health"), ("sync", "  of which: weight push + version check"),
            ("router", "  of which: router add_worker (until listed healthy)"),
            ("idle", "burst end -> scale-in decision"), ("stop", "scale-in decision -> engine stopped"),
            ("drain", "  of which: off the router + drained"), ("halt", "  of which: server stopped")]
    print(f"\n{'seconds (median of ' + str(len(results)) + ' rounds)':<66} {'median':>7} {'per round':>20}")
    for key, what in rows:
        per = " ".join(f"{r[key]:.2f}" for r in results)
        print(f"{what:<66} {med(key):>7.2f} {per:>20}")
    print(f"generated tokens/s during the burst: 1 engine {med('tps1'):.0f}, 2 engines {med('tps2'):.0f} "
          f"({med('tps2') / med('tps1'):.2f}x)")
    print(f"requests: {sum(r['sent'] for r in results)} sent, {sum(r['answered'] for r in results)} answered, "
          f"{sum(r['failed'] for r in results)} failed")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="autoscaler YAML (default: the built-in short-window one)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--clients", type=int, default=12, help="concurrent /generate clients during a burst")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--after-out", type=float, default=8.0, help="seconds the burst goes on after the scale-out")
    p.add_argument("--burst-timeout", type=float, default=120.0, help="longest burst that waits for a scale-out")
    p.add_argument("--quiet-timeout", type=float, default=120.0, help="longest wait for the scale-in")
    p.add_argument("--ray-cpus", type=int, default=4)
    p.add_argument("--workdir", default=None, help="output dir (default: a temporary folder)")
    args = p.parse_args()

    from relax.wire.auth import ENGINE_API_KEY_ENV, ensure_engine_api_key
    from relax.backends.sglang.router import RouterProcess
    from relax.config import parse_config
    from relax.config.autoscaler import load_autoscaler_config
    from relax.config.env import worker_env
    from relax.models.embedded import build_embedded_assets
    from relax.roles.engine import EngineActor
    from relax.rollout.engine_pool import EnginePool
    from rollout_bench import init_local_ray  # benchmarks/ is this script's folder

    tmp = tempfile.TemporaryDirectory(prefix="relax-autoscaler-bench-") if args.workdir is None else None
    workdir = args.workdir or tmp.name
    os.makedirs(workdir, exist_ok=True)
    config_path = args.config
    if config_path is None:
        config_path = os.path.join(workdir, "autoscaler.yaml")
        with open(config_path, "w") as f:
            yaml.safe_dump(DEFAULT_CONFIG, f)
    cfg = load_autoscaler_config(config_path)  # errors name the file and the key, as --autoscaler-config does
    if cfg.max_engines < 2 or cfg.min_engines != 1:
        raise SystemExit(f"{config_path}: the benchmark starts 1 engine and needs min_engines 1, max_engines >= 2")
    base = parse_config(["--output-dir", workdir])
    build_embedded_assets(base.hf_checkpoint, base.prompt_data, seed=base.seed % 1000)
    log_dir = os.path.join(workdir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    print(f"autoscaler config {config_path}"
          f"{' (built-in: short windows, a round takes ~30 s)' if args.config is None else ''}: {cfg.as_dict()}")
    print(f"{args.rounds} rounds, {args.clients} clients x {args.max_new_tokens} tokens, engines: 1 thread, "
          f"max_running_requests {SERVER_ARGS['max_running_requests']}; {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)

    # the engines and router share the key
    init_local_ray(args.ray_cpus, {**worker_env(), ENGINE_API_KEY_ENV: ensure_engine_api_key()})

    def make_actor(engine_id, placement):
        return EngineActor.options(num_cpus=0).remote("embedded", base.hf_checkpoint, SERVER_ARGS, 1, log_dir,
                                                      engine_id)

    router = pool = scaler = poller = None
    results: list[dict] = []
    try:
        router = RouterProcess(host="127.0.0.1", policy="round_robin",
                               log_path=os.path.join(log_dir, "router.log")).start()
        pool = EnginePool(router, make_actor=make_actor, control_timeout_s=30, start_timeout_s=180,
                          sync_timeout_s=120)
        pool.stop_timeout_s = 30.0  # --scale-in-shutdown-timeout's default
        t0 = time.time()
        (first,) = pool.start_initial([None])
        source = WeightSource.remote(base.hf_checkpoint, VERSION)
        ray.get(source.push_kept_weights.remote([first]))  # the "last push" the trainer made before the burst
        pool.set_weight_version(VERSION, [first])
        pool.weight_source = source
        print(f"router + 1 engine up and at weight version {VERSION} in {time.time() - t0:.1f} s", flush=True)
        scaler = TimedAutoscaler(cfg, pool, scale_out_timeout_s=180, partial_policy="rollback_all",
                                 drain_timeout_s=30, log_path=os.path.join(workdir, "autoscaler.jsonl")).start()
        poller = StatePoller(pool)
        for n in range(1, args.rounds + 1):
            results.append(one_round(n, args, pool, scaler, router, poller))
            if not results[-1]["ok"]:
                break
            time.sleep(1.0)
        decisions = [d for d in scaler.status()["decisions"] if d["action"] != "hold"]
        print("decisions:", [(d["action"], d["delta"], d["engines"]) for d in decisions])
    except KeyboardInterrupt:  # the finally below still stops everything this run started
        print("interrupted: shutting down", file=sys.stderr)
    finally:
        if poller is not None:
            poller.stop()
        if scaler is not None:
            scaler.stop()  # before the pool: no scaling starts while the engines stop
        if pool is not None:
            pool.shutdown()
        if router is not None:
            router.stop()
        ray.shutdown()
        if tmp is not None:
            tmp.cleanup()
    bad = [r for r in results if not r["ok"]]
    if len(results) == args.rounds and not bad:
        report(results)
    for r in bad:
        print(f"round {r['round']} FAILED: {r.get('why')}", file=sys.stderr)
    return 0 if results and not bad and len(results) == args.rounds else 1


if __name__ == "__main__":
    raise SystemExit(main())
