"""Start-up of relax-train: launch to the first rollout request, cold and warm (issue 13's target: under 20 s
for the embedded default, under 25 s for SmolLM2-135M on a 2-core machine).

    .venv/bin/python benchmarks/startup_bench.py                    # both models, cold then warm
    .venv/bin/python benchmarks/startup_bench.py --only embedded --warm-runs 2
    .venv/bin/python benchmarks/startup_bench.py --only embedded --warm-runs 1 --cpu   # and each process's CPU
    .venv/bin/python benchmarks/startup_bench.py --against /tmp/before --rounds 3 --cpu  # two code states, alternated

Each run is `relax-train ... --num-rollout 1 --timeline-dump-dir DIR` in a subprocess. Launch is the moment
just before the subprocess starts; the times after it come from the run's timeline (wall clock):
  first request  the start of the rollout manager's first "generate and reward" span: the step's rollout
                 request, sent once the trainer, reference, engines and data plane are up
  first token    the start of the first "generate" span of an engine (its first batch of requests)
  step 0 end     the end of the controller's "step 0" span
  exit           the subprocess's end (shutdown included)

Cold and warm:
  embedded  cold: RELAX_EMBEDDED_CACHE is a new empty folder, so the tiny model, its warm start and the task
            are built (~3 s of CPU); warm: the same folder again, so they are copied from it.
  smollm2   SmolLM2-135M-Instruct's weights cannot be downloaded on this machine (no model hub), so the
            benchmark builds a model of its exact shape (the config below: Llama, 30 layers, hidden 576, 9
            heads, 3 KV heads, vocabulary 49152, tied embeddings; ~135M parameters) with random weights in float32
            safetensors, as scripts/convert_smollm2.py writes the real one, and the embedded default's byte-level
            tokenizer and ChatML template (the tokenizer does not change start-up work). Cold: the first run after
            the folder is written; warm: the runs after it. Flags as examples/smollm2/run.sh.
Two code states (`--against DIR`: a checkout of the other code, e.g. `git worktree add DIR COMMIT`, run with
PYTHONPATH=DIR from DIR as its working folder, checked before the runs; compile its bytecode first, as
scripts/setup.sh does here, or it pays for compiling): the embedded default only; each side's cold run (its own
cache folder) first, then `--rounds` rounds of one warm run of the other code and one of this code, and the mean of
each side's warm times and their ratio. The machine's speed drifts over minutes, so only rounds alternated like
this compare.

Start-up is CPU-bound (~8 processes importing torch, Megatron and TransferQueue on the machine's cores): the
numbers depend on the load, which the benchmark prints (`os.getloadavg`) before each run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from relax.models.tasks import generate_task_dataset
from relax.models.tiny import TinyArch, build_byte_tokenizer, build_hf_config
from relax.observability.timeline import read_spans

# HuggingFaceTB/SmolLM2-135M-Instruct's config.json, less what does not change the work (token ids).
SMOLLM2_135M = TinyArch(family="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                        rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
SMOLLM2_VOCAB = 49152
ROOT = Path(__file__).resolve().parents[1]  # this checkout


def build_smollm2_shaped(path: Path, seed: int = 0) -> Path:
    """A randomly initialised model of SmolLM2-135M's shape in `path` (see the module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    tokenizer = build_byte_tokenizer()
    config = build_hf_config(SMOLLM2_135M, SMOLLM2_VOCAB)
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = None
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    print(f"built a SmolLM2-135M-shaped model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters "
          f"in {path}", flush=True)
    return path


def smollm2_flags(model: Path, data: Path) -> list[str]:
    """examples/smollm2/run.sh's flags."""
    return ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--input-key", "input", "--label-key", "label",
            "--apply-chat-template", "--custom-rm-path", "relax.models.tasks.number_match_rm",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "48",
            "--rollout-temperature", "1.0", "--micro-batch-size", "4", "--lr", "1e-6", "--lr-decay-style", "constant",
            "--distributed-backend", "gloo"]


def run_sampling_cpu(cmd: list[str], env: dict[str, str], launched: float, cwd: Path | None = None):
    """`cmd` to its end, sampling (every 0.1 s) the CPU seconds of each process it starts; (the completed
    process, {pid: (CPU s, seconds after launch it was first seen, its latest command line)}). A process's CPU is
    its last sample's: what it spent in its last 0.1 s is missed."""
    import psutil

    seen: dict[int, list] = {}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
    outputs: dict[str, str] = {}
    readers = [threading.Thread(target=lambda name, f: outputs.__setitem__(name, f.read()), args=(name, f),
                                daemon=True) for name, f in (("stdout", proc.stdout), ("stderr", proc.stderr))]
    for r in readers:
        r.start()
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for p in procs:
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    if p.pid not in seen:
                        seen[p.pid] = [0.0, time.time() - launched, ""]
                    # the latest command line: a Ray worker's names its actor once it has one
                    seen[p.pid][0], seen[p.pid][2] = t.user + t.system, " ".join(p.cmdline())[:90]
            except psutil.Error:
                pass
        time.sleep(0.1)
    for r in readers:
        r.join()
    done = subprocess.CompletedProcess(cmd, proc.wait(), outputs.get("stdout", ""), outputs.get("stderr", ""))
    return done, {pid: tuple(v) for pid, v in seen.items()}


def show_cpu(rows: list[tuple]) -> None:
    """Print each process's CPU seconds (`rows`: (CPU s, started, command line), most first), below its run's line."""
    print(f"  CPU s in all: {sum(r[0] for r in rows):.1f} over {len(rows)} processes", flush=True)
    for cpu_s, started, cmdline in rows:
        if cpu_s >= 0.3:
            print(f"  {cpu_s:5.1f} CPU s  from {started:5.1f} s  {cmdline}", flush=True)


def timed_run(out: Path, flags: list[str], env: dict[str, str], cpu: bool = False,
              base_env: dict[str, str] | None = None, cwd: Path | None = None) -> dict[str, float]:
    """One 1-step run; seconds from launch to each moment of the module docstring. `cpu`: also print the CPU
    seconds of each process the run started (their sum as "cpu", each as "processes"). `base_env`: the environment the
    run's `env` is added to (default: this process's)."""
    timeline_dir = out / "timeline"
    cmd = [sys.executable, "-m", "relax.entrypoints.train", "--output-dir", str(out), "--num-rollout", "1",
           "--timeline-dump-dir", str(timeline_dir), *flags]
    load = os.getloadavg()[0]
    launched = time.time()
    full_env = {**(os.environ if base_env is None else base_env), **env}
    if cpu:
        proc, per_process = run_sampling_cpu(cmd, full_env, launched, cwd)
    else:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, cwd=cwd)
    ended = time.time()
    processes = sorted(per_process.values(), key=lambda r: -r[0]) if cpu else []
    cpu_s = sum(r[0] for r in processes) if cpu else float("nan")
    if proc.returncode != 0:  # reported, and the other runs still measured
        failed = [line for line in proc.stderr.splitlines() if "run failed" in line] or proc.stderr.splitlines()[-1:]
        print(f"run failed ({proc.returncode}): {failed[0] if failed else ''}", flush=True)
        nan = float("nan")
        return {"load": load, "first request": nan, "first token": nan, "step 0 end": nan, "exit": ended - launched,
                "cpu": cpu_s, "processes": processes}
    spans = read_spans(timeline_dir)

    def first(pred) -> float:
        starts = [s["ts"] / 1e6 for s in spans if pred(s)]
        return min(starts) - launched if starts else float("nan")

    step0 = [s for s in spans if s["name"] == "step 0"]
    return {
        "load": load,
        "first request": first(lambda s: s["name"] == "generate and reward"),
        "first token": first(lambda s: s["name"] == "generate" and s["cat"] == "engine"),
        "step 0 end": (step0[0]["ts"] + step0[0]["dur"]) / 1e6 - launched if step0 else float("nan"),
        "exit": ended - launched,
        "cpu": cpu_s,
        "processes": processes,
    }


def show(name: str, kind: str, t: dict) -> None:
    print(f"{name:9s} {kind:5s} load {t['load']:5.2f}  first request {t['first request']:6.1f} s  first token "
          f"{t['first token']:6.1f} s  step 0 end {t['step 0 end']:6.1f} s  exit {t['exit']:6.1f} s", flush=True)
    if t.get("processes"):
        show_cpu(t["processes"])


def compare(tmp: Path, against: Path, rounds: int, cpu: bool) -> list[dict]:
    """The embedded default's warm start, alternated between the code in `against` and this code (module
    docstring); prints each run, then each side's means and their ratio."""
    here = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    sides = {"other": {**here, "PYTHONPATH": str(against)}, "this": here}
    # Each side runs in its own checkout's folder: `python -m` puts the working folder first on sys.path, ahead
    # of PYTHONPATH (and Ray's workers get the driver's), so from this folder both sides would run this code.
    folders = {"other": against.resolve(), "this": ROOT}
    for name, env in sides.items():
        imported = subprocess.run([sys.executable, "-c", "import relax; print(relax.__file__)"], env=env,
                                  cwd=folders[name], capture_output=True, text=True).stdout.strip()
        if not imported.startswith(str(folders[name]) + os.sep):
            raise SystemExit(f"{name} side imports relax from {imported or '?'}, not from {folders[name]}")
    results: list[dict] = []
    for name, env in sides.items():  # each side's own cache, built by its own code
        env["RELAX_EMBEDDED_CACHE"] = str(tmp / f"embedded-cache-{name}")
        show(name, "cold", timed_run(tmp / f"{name}-cold", [], {}, False, base_env=env, cwd=folders[name]))
    for r in range(rounds):
        for name, env in sides.items():
            t = timed_run(tmp / f"{name}-{r}", [], {}, cpu, base_env=env, cwd=folders[name])
            show(name, "warm", t)
            results.append({"code": name, "round": r, **t})
    means = {}
    for name in sides:
        rows = [x for x in results if x["code"] == name]
        means[name] = {k: sum(x[k] for x in rows) / len(rows) for k in ("step 0 end", "cpu")}
        print(f"{name:5s} ({against if name == 'other' else 'this checkout'}): mean end of step 0 "
              f"{means[name]['step 0 end']:.1f} s" + (f", {means[name]['cpu']:.1f} CPU s" if cpu else "")
              + f" over {rounds} warm runs", flush=True)
    print(f"this / other, end of step 0: {means['this']['step 0 end'] / means['other']['step 0 end']:.3f}"
          + (f"; CPU s: {means['this']['cpu'] / means['other']['cpu']:.3f}" if cpu else ""), flush=True)
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("embedded", "smollm2"), default=None)
    p.add_argument("--warm-runs", type=int, default=1, help="warm runs after the cold one (default 1)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--cpu", action="store_true", help="also print each process's CPU seconds (psutil, sampled)")
    p.add_argument("--against", default=None, help="a checkout of other code to alternate with this one (module "
                   "docstring); the embedded default only")
    p.add_argument("--rounds", type=int, default=3, help="with --against: warm runs of each side (default 3)")
    p.add_argument("--keep", default=None, help="run in this folder and keep it (logs of each run); default: a "
                   "temporary folder")
    args = p.parse_args()
    if args.against and not (Path(args.against) / "relax").is_dir():
        p.error(f"--against {args.against}: not a checkout of Relax (no relax/ folder in it)")
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="relax-startup-") as tmp:
        tmp = Path(args.keep or tmp)
        if args.against:
            results = compare(tmp, Path(args.against).resolve(), args.rounds, args.cpu)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1))
            return 0
        if args.only in (None, "embedded"):
            env = {"RELAX_EMBEDDED_CACHE": str(tmp / "embedded-cache")}
            for i in range(1 + args.warm_runs):
                kind = "cold" if i == 0 else "warm"
                t = timed_run(tmp / f"embedded-{i}", [], env, args.cpu)
                show("embedded", kind, t)
                results.append({"model": "embedded", "kind": kind, **t})
        if args.only in (None, "smollm2"):
            model = build_smollm2_shaped(tmp / "smollm2-135m-shaped")
            data = generate_task_dataset(tmp / "word_arith.jsonl", 64, 0, task="word_arith")
            for i in range(1 + args.warm_runs):
                kind = "cold" if i == 0 else "warm"
                t = timed_run(tmp / f"smollm2-{i}", smollm2_flags(model, Path(data)), {}, args.cpu)
                show("smollm2", kind, t)
                results.append({"model": "smollm2-135m-shaped", "kind": kind, **t})
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
