"""Rollout throughput: 1, 2 and 4 embedded engines behind the real sglang-router, and reward functions of
different cost (built-in exact_match and math, custom rewards that sleep or burn CPU, sync and async).

    .venv/bin/python benchmarks/rollout_bench.py                     # defaults: a few minutes in all
    .venv/bin/python benchmarks/rollout_bench.py --steps 5 --engines 1 2 --rewards exact_match sleep50

What runs is the default rollout path of `relax.roles.rollout.RolloutManager._rollout`, in this process
so that reward calls and generation can be timed on one clock: a parsed `Config` (the embedded default:
tiny model + synthetic task, built by `relax.models.embedded.build_embedded_assets`), real
`EngineActor`s (embedded engines, Ray actors, 1 thread each) behind a real `RouterProcess`, the
`--data-source-path` data source, `RewardRunner.from_args(config)` and the `--rollout-function-path`
function (`relax.rollout.sglang_rollout.generate_rollout`) called as `fn(RolloutContext, step)`.
The one addition is `--custom-generate-function-path` set to `timed_generate` below: it calls the same
`generate_one` as the default path and notes when each sample's generation finished.

Per configuration (after --warmup steps): samples/s and response tokens/s of the rollout step, and how
reward work sat relative to generation: `gen` = start of the step to the last generation reply,
`tail` = last generation reply to the end of the step (scoring left after generation), `reward busy` =
sum of the custom reward calls' durations (what scoring would cost run one after another), `during gen` =
the share of that busy time spent while samples were still generating. If scoring blocked generation,
the step would take about gen(exact_match) + reward busy; concurrent scoring keeps the step near
gen + one reward call.

Configurations take turns step by step (one step each per round, the order reversed every other round) and
the figures are medians, so the load of other jobs on this machine falls on all of them alike.

This machine has 2 physical cores shared with other jobs: engines beyond the core count run on
time-shared cores and cannot scale linearly here; the figures are measured side by side in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RELAX_PROGRESS", "0")

# --------------------------------------------------------------------------- timing hooks (this process)

GEN_DONE: list[float] = []  # perf_counter() when each sample's generation reply arrived
REWARD_CALLS: list[tuple[float, float]] = []  # (start, end) of each custom reward call


async def timed_generate(ctx, sample, sampling):
    """`--custom-generate-function-path`: the default `generate_one` call, with its end time noted."""
    from relax.rollout.generate import generate_one

    out = await generate_one(ctx.session, ctx.router_url, sample, sampling, timeout_s=ctx.timeout_s,
                             retries=ctx.retries, max_context_len=ctx.args.rollout_max_context_len)
    GEN_DONE.append(time.perf_counter())
    return out


def _exact(sample) -> float:
    from relax.rollout.rewards.registry import get_reward_fn

    return get_reward_fn("exact_match")(sample.response_text, sample.label, sample.metadata)


def _burn(seconds: float) -> None:
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1


def _make_sync(seconds: float, burn: bool):
    def reward(args, sample):
        t0 = time.perf_counter()
        _burn(seconds) if burn else time.sleep(seconds)
        r = _exact(sample)
        REWARD_CALLS.append((t0, time.perf_counter()))
        return r
    return reward


def _make_async(seconds: float):
    async def reward(args, sample):
        t0 = time.perf_counter()
        await asyncio.sleep(seconds)
        r = _exact(sample)
        REWARD_CALLS.append((t0, time.perf_counter()))
        return r
    return reward


sleep5 = _make_sync(0.005, burn=False)
sleep50 = _make_sync(0.050, burn=False)
async_sleep5 = _make_async(0.005)
async_sleep50 = _make_async(0.050)
burn5 = _make_sync(0.005, burn=True)
burn50 = _make_sync(0.050, burn=True)

REWARDS = {  # name -> reward flags
    "exact_match": ["--rm-type", "exact_match"],
    "math": ["--rm-type", "math"],
    **{name: ["--custom-rm-path", f"__main__.{name}"]
       for name in ("sleep5", "sleep50", "async_sleep5", "async_sleep50", "burn5", "burn50")},
}
DESCRIBE = {"exact_match": "built-in exact_match", "math": "built-in math (sympy)",
            "sleep5": "sync, sleeps 5 ms", "sleep50": "sync, sleeps 50 ms", "async_sleep5": "async, sleeps 5 ms",
            "async_sleep50": "async, sleeps 50 ms", "burn5": "sync, burns 5 ms CPU",
            "burn50": "sync, burns 50 ms CPU"}


# --------------------------------------------------------------------------- one configuration


@dataclass
class StepFigures:
    seconds: float
    samples: int
    tokens: int
    gen: float
    tail: float
    reward_busy: float
    reward_during_gen: float
    reward_mean: float


@dataclass
class Result:
    engines: int
    reward: str
    steps: list[StepFigures] = field(default_factory=list)
    builtin_call_ms: float | None = None

    def mean(self, key: str) -> float:
        return statistics.fmean(getattr(s, key) for s in self.steps)

    def median(self, key: str) -> float:
        return statistics.median(getattr(s, key) for s in self.steps)

    def total(self, key: str) -> float:
        return sum(getattr(s, key) for s in self.steps)


def parse(args: argparse.Namespace, reward: str, engines: int, workdir: str):
    from relax.config import parse_config

    return parse_config([
        "--output-dir", workdir, "--rollout-batch-size", str(args.batch), "--n-samples-per-prompt",
        str(args.n), "--rollout-max-response-len", str(args.max_len), "--num-rollout", "1000",
        "--resource", json.dumps({"actor": [1, 1], "rollout": [1, engines]}), "--rollout-seed", "7",
        "--custom-generate-function-path", "__main__.timed_generate", *REWARDS[reward]])


def time_builtin(reward: str, samples) -> float:
    """Mean ms of one built-in reward call over the step's samples, called one after another."""
    from relax.rollout.rewards.registry import get_reward_fn

    fn = get_reward_fn(reward)
    t0 = time.perf_counter()
    for s in samples:
        fn(s.response_text, s.label, s.metadata)
    return (time.perf_counter() - t0) / max(1, len(samples)) * 1e3


class Setup:
    """One configuration's rollout pieces, built once and stepped round by round."""

    def __init__(self, args, reward: str, engines: int, router, workdir: str):
        from transformers import AutoTokenizer

        from relax.rollout.buffer import build_data_source
        from relax.rollout.context import RolloutContext, load_hook
        from relax.rollout.prompts import PromptEncoder
        from relax.rollout.rewards import RewardRunner

        config = parse(args, reward, engines, workdir)
        tokenizer = AutoTokenizer.from_pretrained(config.hf_checkpoint)
        encoder = PromptEncoder.from_args(config, tokenizer)
        self.rewards = RewardRunner.from_args(config)
        self.rollout_fn = load_hook(config.rollout_function_path, "--rollout-function-path")
        self.ctx = RolloutContext(args=config, tokenizer=tokenizer, data_source=build_data_source(config, encoder),
                                  rewards=self.rewards, router_url=router.url)
        self.result = Result(engines=engines, reward=reward)
        self.step_no = 0
        self.last_samples: list = []

    def step(self, urls: list[str], measured: bool) -> None:
        from relax.rollout.context import RolloutOutput

        self.ctx.engine_urls = list(urls)
        GEN_DONE.clear()
        REWARD_CALLS.clear()
        t0 = time.perf_counter()
        out = self.rollout_fn(self.ctx, self.step_no)
        t1 = time.perf_counter()
        self.step_no += 1
        groups = out.groups if isinstance(out, RolloutOutput) else out
        samples = [s for g in groups for s in g]
        if not measured:
            return
        gen_end = max(GEN_DONE)
        self.result.steps.append(StepFigures(
            seconds=t1 - t0, samples=len(samples), tokens=sum(len(s.response_tokens) for s in samples),
            gen=gen_end - t0, tail=t1 - gen_end, reward_busy=sum(b - a for a, b in REWARD_CALLS),
            reward_during_gen=sum(max(0.0, min(b, gen_end) - a) for a, b in REWARD_CALLS),
            reward_mean=statistics.fmean(float(s.reward) for s in samples)))
        self.last_samples = samples

    def finish(self) -> Result:
        self.rewards.close()
        if self.result.reward in ("exact_match", "math"):
            self.result.builtin_call_ms = time_builtin(self.result.reward, self.last_samples)
        return self.result


# --------------------------------------------------------------------------- report


def row(r: Result) -> str:
    step = r.median("seconds")
    busy = r.median("reward_busy")
    during = r.total("reward_during_gen") / r.total("reward_busy") if r.total("reward_busy") > 0 else float("nan")
    per_call = (f"{r.builtin_call_ms:7.2f}" if r.builtin_call_ms is not None
                else f"{busy / max(1, r.mean('samples')) * 1e3:7.2f}")
    busy_txt = f"{busy:6.2f}" if busy > 0 else "     -"
    during_txt = f"{during:7.0%}" if busy > 0 else "      -"
    spread = f"{min(x.seconds for x in r.steps):.2f}-{max(x.seconds for x in r.steps):.2f}"
    return (f"{r.engines:>7} {r.reward:<14} {r.mean('samples') / step:9.1f} {r.mean('tokens') / step:9.1f} "
            f"{step:6.2f} {spread:>11} {r.median('gen'):6.2f} {r.median('tail'):6.3f} {per_call} {busy_txt} "
            f"{during_txt} {r.mean('reward_mean'):6.3f}")


HEADER = (f"{'engines':>7} {'reward':<14} {'samples/s':>9} {'tokens/s':>9} {'step s':>6} {'min-max s':>11} "
          f"{'gen s':>6} {'tail s':>6} {'call ms':>7} {'busy s':>6} {'dur.gen':>7} {'reward':>6}")



def init_local_ray(num_cpus: int, env_vars: dict[str, str]) -> None:
    """A local Ray for a benchmark, tried up to 5 times: Ray's node start-up wait is a fixed 30 s, too short on a
    busy machine."""
    import ray

    for attempt in range(5):
        try:
            ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env={"env_vars": env_vars},
                     log_to_driver=False)
            return
        except Exception as exc:
            ray.shutdown()
            if attempt == 4:
                raise
            print(f"ray.init failed ({str(exc)[:80]}...); retrying")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=int, nargs="+", default=[1, 2, 4], help="engine counts to compare")
    p.add_argument("--rewards", nargs="+", default=list(REWARDS), choices=list(REWARDS),
                   help="reward functions to compare (at --reward-engines engines)")
    p.add_argument("--reward-engines", type=int, default=2, help="engines used for the reward comparison")
    p.add_argument("--batch", type=int, default=16, help="--rollout-batch-size (prompts per step)")
    p.add_argument("--n", type=int, default=8, help="--n-samples-per-prompt")
    p.add_argument("--max-len", type=int, default=8, help="--rollout-max-response-len")
    p.add_argument("--steps", type=int, default=3, help="measured steps per configuration")
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps per configuration (not measured)")
    p.add_argument("--ray-cpus", type=int, default=32, help="logical CPUs given to Ray")
    p.add_argument("--workdir", default=None, help="output dir (default: a temporary folder)")
    args = p.parse_args()

    import ray

    from relax.backends.sglang.router import RouterProcess
    from relax.config.env import worker_env
    from relax.models.embedded import build_embedded_assets
    from relax.roles.engine import EngineActor

    tmp = tempfile.TemporaryDirectory(prefix="relax-rollout-bench-") if args.workdir is None else None
    workdir = args.workdir or tmp.name
    base = parse(args, "exact_match", 1, workdir)
    assets = build_embedded_assets(base.hf_checkpoint, base.prompt_data, seed=base.seed % 1000)
    need = max(max(args.engines), args.reward_engines)
    print(f"embedded default: {base.hf_checkpoint} ({'reused' if assets['reused'] else 'built'}), "
          f"{assets['num_prompts']} prompts of task {assets['task']!r}")
    print(f"step: {args.batch} prompts x {args.n} samples, <= {args.max_len} response tokens, "
          f"{args.warmup} warm-up + {args.steps} measured steps per row; engines: 1 thread each; "
          f"Ray: {args.ray_cpus} logical CPUs on {os.cpu_count()} cores")
    print(f"note: {os.cpu_count()} cores shared with other jobs (load average now "
          f"{os.getloadavg()[0]:.1f}): more engines than cores cannot scale linearly here.")
    sys.stdout.flush()

    init_local_ray(args.ray_cpus, worker_env())
    engines, router = [], None
    results: list[Result] = []
    try:
        log_dir = os.path.join(workdir, "logs")
        os.makedirs(log_dir, exist_ok=True)
        server_args = {"dtype": "float32", "random_seed": base.rollout_seed, "num_threads": 1,
                       "max_running_requests": 256}
        engines = [EngineActor.options(num_cpus=1).remote("embedded", base.hf_checkpoint, server_args, 1, log_dir, i)
                   for i in range(need)]
        t0 = time.perf_counter()
        urls = ray.get([e.start.remote() for e in engines])
        router = RouterProcess(host="127.0.0.1", policy="round_robin",
                               log_path=os.path.join(log_dir, "router.log")).start()
        print(f"{need} engines + router up in {time.perf_counter() - t0:.1f} s")
        plan = [(e, "exact_match") for e in args.engines]
        plan += [(args.reward_engines, r) for r in args.rewards if (args.reward_engines, r) not in plan]
        setups = [Setup(args, reward, n_eng, router, workdir) for n_eng, reward in plan]
        active: list[str] = []

        def use(n_eng: int) -> list[str]:
            while len(active) < n_eng:
                router.add_worker(urls[len(active)])
                active.append(urls[len(active)])
            while len(active) > n_eng:
                router.remove_worker(active.pop())
            return active

        # Configurations take turns, one step each per round (order reversed every other round), so the
        # load of the other jobs on this machine falls on all of them alike.
        rounds = args.warmup + args.steps
        for rnd in range(rounds):
            order = list(zip(plan, setups))
            for (n_eng, _), setup in (order if rnd % 2 == 0 else order[::-1]):
                setup.step(use(n_eng), measured=rnd >= args.warmup)
            print(f"round {rnd + 1}/{rounds} done ({'warm-up' if rnd < args.warmup else 'measured'}), "
                  f"load average {os.getloadavg()[0]:.1f}")
            sys.stdout.flush()
        results = [setup.finish() for setup in setups]
        print(HEADER)
        for r in results:
            print(row(r))
    finally:
        if router is not None:
            router.stop()
        for e in engines:
            try:
                ray.get(e.shutdown.remote(), timeout=30)
            except Exception as exc:  # the engine actor may already be gone; ray.shutdown() follows
                print(f"engine shutdown: {type(exc).__name__}")
        ray.shutdown()
        if tmp is not None:
            tmp.cleanup()

    print()
    print("columns (medians over the measured steps): samples/s and tokens/s (response tokens) per step time;")
    print("step s = step time (min-max s: its range); gen s = step start to last generation reply; tail s = last")
    print("reply to step end (scoring left after generation); call ms = one reward call (built-ins: timed alone on")
    print("the step's samples afterwards; custom: measured inside the rollout); busy s = summed custom reward time")
    print("per step; dur.gen = share of that time spent while samples were still generating; reward = mean reward.")
    print("Sync rewards run in the RewardRunner's thread pool (8 threads): at most 8 run at once, so 50 ms sync")
    print("rewards queue and leave a tail; async rewards all run at once.")
    by = {(r.engines, r.reward): r for r in results}
    base_eng = by.get((args.engines[0], "exact_match"))
    for e in args.engines[1:]:
        if base_eng and (e, "exact_match") in by:
            r = by[(e, "exact_match")]
            speed = (r.mean("samples") / r.median("seconds")) / (base_eng.mean("samples") / base_eng.median("seconds"))
            print(f"{e} engines vs {args.engines[0]}: {speed:.2f}x samples/s (linear would be "
                  f"{e / args.engines[0]:.0f}x; {os.cpu_count()} shared cores)")
    ref = by.get((args.reward_engines, "exact_match"))
    print(f"rewards at {args.reward_engines} engines (step time with exact_match: {ref.median('seconds'):.2f} s; "
          "step times move with the machine's load, the tail is measured within each step):" if ref else "rewards:")
    for name in args.rewards:
        r = by.get((args.reward_engines, name))
        if r is None or name == "exact_match":
            continue
        busy = r.median("reward_busy")
        if busy > 0:
            during = r.total("reward_during_gen") / r.total("reward_busy")
            print(f"  {name:<14} ({DESCRIBE[name]}): {busy:.2f} s of reward work per step, {during:.0%} of it while "
                  f"samples were generating; left after the last generation reply: {r.median('tail'):.3f} s "
                  f"(scoring after generation, one call at a time, would add {busy:.2f} s); step "
                  f"{r.median('seconds'):.2f} s")
        else:
            print(f"  {name:<14} ({DESCRIBE[name]}): {r.builtin_call_ms:.2f} ms per call; left after the last "
                  f"generation reply: {r.median('tail'):.3f} s; step {r.median('seconds'):.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
