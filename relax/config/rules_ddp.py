"""Cross-flag rules of the data-parallel wrapper's flags, as Megatron-LM's own argument checks make them (its
arguments.py stops on the same combinations): functions (values, explicit) -> None raising ConfigError, run with
relax.config.rules_training.RULES before Ray."""

from __future__ import annotations

from relax.config.errors import ConfigError


def _actor_data_parallel(v: dict) -> int | None:
    """The actor's data-parallel size (its trainer ranks over TP x PP x CP), None when it does not divide."""
    replicas, gpus = (v.get("resource") or {}).get("actor", [1, 1])
    split = ((v.get("tensor_model_parallel_size") or 1) * (v.get("pipeline_model_parallel_size") or 1)
             * (v.get("context_parallel_size") or 1))
    ranks = replicas * gpus
    return ranks // split if ranks % split == 0 else None


def check_param_gather(v: dict, explicit) -> None:
    """--overlap-param-gather overlaps the distributed optimizer's param all-gather with the next forward pass and
    finishes it in DDP's forward pre-hooks, which the overlapped grad reduce's bucketing sets up (Megatron-LM:
    "--overlap-param-gather only supported with distributed optimizer", "Must use --overlap-param-gather with
    --overlap-grad-reduce"). --no-align-param-gather only changes when that overlapped all-gather starts; without
    it the flag would do nothing."""
    if v.get("overlap_param_gather"):
        missing = [flag for dest, flag in (("use_distributed_optimizer", "--use-distributed-optimizer"),
                                           ("overlap_grad_reduce", "--overlap-grad-reduce")) if not v.get(dest)]
        if missing:
            raise ConfigError(f"--overlap-param-gather needs {' and '.join(missing)} (as in Megatron-LM: the "
                              "distributed optimizer's all-gather is what it overlaps, in the overlapped grad "
                              "reduce's buckets); add them or drop --overlap-param-gather")
    elif "align_param_gather" in explicit and v.get("align_param_gather") is False:
        raise ConfigError("--no-align-param-gather changes when --overlap-param-gather's all-gathers start; without "
                          "--overlap-param-gather it does nothing: add it or drop --no-align-param-gather")


def check_distributed_optimizer_instances(v: dict, explicit) -> None:
    """--num-distributed-optimizer-instances N shards the distributed optimizer over DP / N ranks and all-reduces
    the gradients across the N instances (Megatron-LM: "only supported in combination with
    --use-distributed-optimizer"; Megatron's initialize_model_parallel needs N to divide the data-parallel size)."""
    n = v.get("num_distributed_optimizer_instances") or 1
    if n == 1:
        return
    if n < 1:
        raise ConfigError(f"--num-distributed-optimizer-instances must be at least 1, got {n}")
    if not v.get("use_distributed_optimizer"):
        raise ConfigError(f"--num-distributed-optimizer-instances {n} shards the distributed optimizer: add "
                          "--use-distributed-optimizer (as in Megatron-LM) or drop it")
    dp = _actor_data_parallel(v)
    if dp is not None and dp % n:
        raise ConfigError(f"--num-distributed-optimizer-instances {n} must divide the actor's data-parallel size "
                          f"{dp} (--resource actor over tensor x pipeline x context parallel)")


def check_nccl_user_buffers(v: dict, explicit) -> None:
    """--disable-symmetric-registration chooses how --use-nccl-ub's user buffers are registered; alone it does
    nothing."""
    if v.get("disable_symmetric_registration") and not v.get("nccl_ub"):
        raise ConfigError("--disable-symmetric-registration changes how --use-nccl-ub registers its NCCL user buffers; "
                          "add --use-nccl-ub or drop it")


def check_timeout_after_init(v: dict, explicit) -> None:
    seconds = v.get("distributed_timeout_seconds_after_init")
    if seconds is not None and seconds <= 0:
        raise ConfigError(f"--distributed-timeout-seconds-after-init must be a positive number of seconds, got "
                          f"{seconds}")


RULES: tuple = (check_param_gather, check_distributed_optimizer_instances, check_nccl_user_buffers,
                check_timeout_after_init)
