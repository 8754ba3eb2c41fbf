"""Profiles and memory records of the trainer ranks.

- `--use-pytorch-profiler` (Megatron-LM's switch, with its `--profile-step-start/-end` and `--profile-ranks`)
  profiles the chosen `--profile-target` sections with `torch.profiler` on those steps and ranks: `train_overall`
  (the whole training call of a step on the rank), `train_actor` (the actor's optimizer updates),
  `train_log_probs` (the forward passes that compute log-probs before the update); a target inside another that
  is profiled (train_actor inside train_overall) is a labelled range of the outer trace, since a process runs
  one torch.profiler session at a time. `--profile-with-stack/
  -memory/-flops` are torch.profiler's `with_stack`, `profile_memory`, `with_flops`. Each profiled section is
  written as a Chrome trace `<--output-dir>/profiles/<target>-step<N>-rank<R>.json`.
  CUDA activity is recorded too when there is a GPU.
- `--memory-snapshot-num-steps N` records memory for the first N training steps of the run into
  `--memory-snapshot-dir`: `--memory-recorder torch` is PyTorch's CUDA allocator history
  (`memory-rank<R>.pickle`, for pytorch.org/memory_viz; GPU only, refused on CPU before Ray), `memray` is
  memray's tracker of the rank process (`memray-rank<R>.bin`, host memory; `memray flamegraph FILE`).
- `--enable-cuda-memory-check` logs the free GPU memory before every torch.distributed collective and adds it
  to the message of a collective that fails (GPU only).
"""

from __future__ import annotations

import functools
import logging
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

TARGETS = ("train_overall", "train_actor", "train_log_probs")
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "all_to_all", "all_to_all_single", "barrier", "send", "recv")


@dataclass
class Profiling:
    rank: int
    targets: tuple[str, ...] = ()
    steps: range = range(0)
    ranks: tuple[int, ...] = (0,)
    profile_dir: Path = Path(".")
    with_stack: bool = False
    with_memory: bool = False
    with_flops: bool = False
    snapshot_dir: Path = Path(".")
    snapshot_steps: int = 0
    recorder: str = "torch"
    _recording: Any = field(default=None, repr=False)
    _running: dict = field(default_factory=dict, repr=False)
    _recorded_steps: int = field(default=0, repr=False)

    @classmethod
    def from_config(cls, config: Any, rank: int) -> "Profiling":
        profile_dir = Path(config.output_dir) / "profiles"
        return cls(rank=rank,
                   targets=tuple(config.profile_target or ()) if config.use_pytorch_profiler else (),
                   steps=range(config.profile_step_start, config.profile_step_end),
                   ranks=tuple(config.profile_ranks or (0,)), profile_dir=profile_dir,
                   with_stack=bool(config.profile_with_stack), with_memory=bool(config.profile_with_memory),
                   with_flops=bool(config.profile_with_flops), snapshot_dir=Path(config.memory_snapshot_dir or "."),
                   snapshot_steps=int(config.memory_snapshot_num_steps or 0), recorder=config.memory_recorder)

    def profiles(self, target: str, step: int) -> bool:
        return target in self.targets and step in self.steps and self.rank in self.ranks

    @contextmanager
    def section(self, target: str, step: int) -> Iterator[None]:
        """Profile the block when `target` is chosen for this step and rank; otherwise just run it."""
        self.start(target, step)
        try:
            yield
        finally:
            self.stop(target, step)

    def start(self, target: str, step: int) -> None:
        """Start profiling `target` (for a section that spans several calls, e.g. train_overall); see `stop`."""
        if not self.profiles(target, step) or (target, step) in self._running:
            return
        if self._running:  # one torch.profiler session per process: inside another, a labelled range of it
            label = torch.profiler.record_function(target)
            label.__enter__()
            self._running[(target, step)] = label
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(activities=activities, with_stack=self.with_stack,
                                      profile_memory=self.with_memory, with_flops=self.with_flops)
        prof.start()
        self._running[(target, step)] = prof

    def stop(self, target: str, step: int) -> None:
        """Stop profiling `target` and write its Chrome trace (nothing when it was not started)."""
        prof = self._running.pop((target, step), None)
        if prof is None:
            return
        if isinstance(prof, torch.profiler.record_function):
            prof.__exit__(None, None, None)
            return
        prof.stop()
        self.profile_dir.mkdir(parents=True, exist_ok=True)
        path = self.profile_dir / f"{target}-step{step}-rank{self.rank}.json"
        prof.export_chrome_trace(str(path))
        logger.info("profile of %s at step %d written to %s", target, step, path)

    @contextmanager
    def memory_step(self) -> Iterator[None]:
        """Around one training step: records memory for the run's first `snapshot_steps` steps, then writes it."""
        self.memory_begin()
        try:
            yield
        finally:
            self.memory_end()

    def memory_begin(self) -> None:
        """At the start of a training step (see `memory_step`)."""
        if self._recorded_steps < self.snapshot_steps and self._recording is None:
            self._recording = self._start_recording()

    def memory_end(self) -> None:
        """At the end of a training step: after the first `snapshot_steps` steps the record is written."""
        if self._recording is None or self._recording == "done":
            return
        self._recorded_steps += 1
        if self._recorded_steps >= self.snapshot_steps:
            self._stop_recording()

    def _start_recording(self) -> Any:
        self.snapshot_dir.mkdir(parents=True, exist_ok=True)
        if self.recorder == "memray":
            import memray  # an optional dependency: only a run that asks for it needs it

            path = self.snapshot_dir / f"memray-rank{self.rank}.bin"
            path.unlink(missing_ok=True)  # memray refuses to overwrite
            tracker = memray.Tracker(str(path))
            stack = ExitStack()
            stack.enter_context(tracker)
            return stack
        if not torch.cuda.is_available():
            raise RuntimeError("--memory-recorder torch records CUDA allocations and needs a GPU; use "
                               "--memory-recorder memray on CPU")
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        return "torch"

    def _stop_recording(self) -> None:
        if self._recording is None:
            return
        if self.recorder == "memray":
            self._recording.close()
            logger.info("memray record of rank %d written to %s", self.rank,
                        self.snapshot_dir / f"memray-rank{self.rank}.bin")
        else:
            path = self.snapshot_dir / f"memory-rank{self.rank}.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
            torch.cuda.memory._record_memory_history(enabled=None)
            logger.info("CUDA memory snapshot of rank %d written to %s", self.rank, path)
        self._recording = "done"


def install_cuda_memory_check() -> None:
    """Wrap torch.distributed's collectives: free GPU memory logged before each, added to a failure's message."""
    if not torch.cuda.is_available():
        raise RuntimeError("--enable-cuda-memory-check reads GPU memory and needs a GPU")
    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None or getattr(original, "relax_memory_checked", False):
            continue
        setattr(dist, name, _checked(name, original))


def _checked(name: str, original: Any) -> Any:
    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        free, total = torch.cuda.mem_get_info()
        logger.debug("%s: %.2f of %.2f GiB free on cuda:%d", name, free / 2**30, total / 2**30,
                     torch.cuda.current_device())
        try:
            return original(*args, **kwargs)
        except Exception as exc:
            raise type(exc)(f"{exc} [torch.distributed.{name} with {free / 2**30:.2f} of {total / 2**30:.2f} GiB "
                            f"free on cuda:{torch.cuda.current_device()} before the call]") from exc

    call.relax_memory_checked = True
    return call
