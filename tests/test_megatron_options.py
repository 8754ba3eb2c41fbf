"""Megatron flags passed to Megatron-core's config objects as they are (relax.config.megatron_options): each reaches
its field in the trainer's TransformerConfig, OptimizerConfig, DDP config or scheduler, and changes what it should;
the GPU-only ones are refused on a CPU-only run with the reason."""

import pytest
import torch

from relax.backends.megatron.testing import (
    build_random_tiny_model,
    build_random_tiny_moe_model,
    ensure_single_process,
    hf_arch,
    hf_trainer,
    toy_pg_loss,
    toy_samples,
)
from relax.config import ConfigError, parse_config
from relax.config.megatron_options import ALL_OPTIONS, GPU_OPTIONS
from relax.config.support import unsupported_flags
from relax.config.support_gpu import GPU_ONLY_OPTION_REASONS, require_gpu_for
from relax.roles.megatron_settings import trainer_settings

torch.set_num_threads(1)


def _settings(tmp_path, *flags):
    config = parse_config(["--output-dir", str(tmp_path), *flags])
    assert unsupported_flags(config) == []
    return config, trainer_settings(config)


def test_every_option_is_a_flag_and_every_gpu_option_has_a_reason():
    from relax.config.parser import actions_by_dest, build_parser

    dests = set(actions_by_dest(build_parser(use_megatron_parser=False)[0]))
    assert ALL_OPTIONS <= dests, sorted(ALL_OPTIONS - dests)
    assert GPU_OPTIONS == set(GPU_ONLY_OPTION_REASONS)


def test_only_flags_set_to_other_values_travel(tmp_path):
    _, settings = _settings(tmp_path, "--init-method-std", "0.02", "--moe-aux-loss-coeff", "0")
    assert settings.megatron_options == ()  # the defaults, restated
    _, settings = _settings(tmp_path, "--moe-aux-loss-coeff", "0.01", "--lr-decay-samples", "64",
                            "--global-batch-size", "8", "--no-align-grad-reduce")
    assert dict(settings.megatron_options) == {"moe_aux_loss_coeff": (0.01,),
                                               "moe_router_load_balancing_type": "aux_loss",
                                               "lr_decay_samples": 64, "global_batch_size": 8,
                                               "align_grad_reduce": False}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU-only machine")
@pytest.mark.parametrize("flags,reason", [
    (["--fp8-format", "e4m3"], "fp8 training with Transformer Engine"),
    (["--fp8-interval", "2"], "a setting of fp8 training"),
    (["--exp-avg-dtype", "bf16"], "--use-precision-aware-optimizer"),
    (["--no-pin-cpu-grads"], "--optimizer-cpu-offload"),
    (["--cpu-offloading-num-layers", "1"], "activation offloading"),
    (["--cp-comm-type", "a2a"], "context-parallel attention"),
    (["--use-sharp"], "SHARP"),
    (["--fp32-residual-connection"], "megatron-core's local layers"),
    (["--use-kitchen-attention"], "Kitchen"),
])
def test_gpu_only_options_are_refused_on_a_cpu_only_run(tmp_path, monkeypatch, flags, reason):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = parse_config(["--output-dir", str(tmp_path), *flags])
    assert unsupported_flags(config) == []
    with pytest.raises(ConfigError, match=f"needs a GPU, and this machine has none: {flags[0]} .*{reason}"):
        require_gpu_for(config)
    # a trainer rank without CUDA refuses them too
    from relax.backends.megatron.megatron_options import require_cuda

    with pytest.raises(ValueError, match=f"{flags[0]} need"):
        require_cuda(trainer_settings(config).megatron_options)
    # the default value is no GPU feature
    require_gpu_for(parse_config(["--output-dir", str(tmp_path), "--fp8-interval", "1", "--exp-avg-dtype", "fp32"]))


def test_gpu_only_options_reach_megatrons_config_objects(tmp_path):
    from relax.backends.megatron.megatron_options import ddp_fields, optimizer_fields, parallel_fields, transformer_fields

    _, settings = _settings(tmp_path, "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--exp-avg-dtype",
                            "bf16", "--optimizer-offload-fraction", "0.5", "--fp8-param-gather",
                            "--cpu-offloading-num-layers", "2", "--te-rng-tracker", "--use-sharp")
    opts = settings.megatron_options
    fields = transformer_fields(opts, is_moe=False)
    assert fields["fp8"] == "hybrid" and fields["fp8_recipe"] == "tensorwise"
    assert fields["cpu_offloading"] is True and fields["cpu_offloading_num_layers"] == 2
    assert optimizer_fields(opts) == {"exp_avg_dtype": torch.bfloat16, "optimizer_offload_fraction": 0.5}
    assert ddp_fields(opts) == {"fp8_param_gather": True}
    assert parallel_fields(opts) == {"use_sharp": True, "te_rng_tracker": True}
    # Megatron-LM's flag names of the uneven pipeline stages -> megatron-core's fields
    _, uneven = _settings(tmp_path, "--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "3")
    assert transformer_fields(uneven.megatron_options, is_moe=False) == {"num_layers_in_first_pipeline_stage": 1,
                                                                        "num_layers_in_last_pipeline_stage": 3}


def test_cpu_options_reach_the_trainers_megatron_objects(tmp_path):
    ensure_single_process()
    path = build_random_tiny_model(tmp_path / "m", "qwen3", seed=1)
    _, settings = _settings(
        tmp_path, "--deterministic-mode", "--apply-query-key-layer-scaling", "--no-clone-scatter-output-in-embedding",
        "--ddp-bucket-size", "1000", "--ddp-average-in-collective", "--overlap-grad-reduce",
        "--min-loss-scale", "2", "--loss-scale-window", "10", "--hysteresis", "3", "--apply-wd-to-qk-layernorm",
        "--override-opt-param-scheduler", "--lr-decay-iters", "10", "--lr-warmup-iters", "0", "--lr-decay-style", "cosine",
        "--lr-warmup-fraction", "0.2", "--start-weight-decay", "0.0", "--end-weight-decay", "0.1",
        "--weight-decay-incr-style", "linear", "--weight-decay", "0.05")
    kwargs = {f: getattr(settings, f) for f in settings.__dataclass_fields__}
    trainer = hf_trainer(path, **{**kwargs, "lr": 1e-3})
    config = trainer.config
    assert config.deterministic_mode and config.apply_query_key_layer_scaling
    assert config.clone_scatter_output_in_embedding is False
    ddp = trainer.model.ddp_config
    assert ddp.bucket_size == 1000 and ddp.average_in_collective and ddp.overlap_grad_reduce
    assert config.no_sync_func == trainer.model.no_sync  # Megatron-LM's hooks for the overlapped reduce
    opt = trainer.optimizer.config
    assert (opt.min_loss_scale, opt.loss_scale_window, opt.hysteresis, opt.apply_wd_to_qk_layernorm) == (2, 10, 3, True)
    sched = trainer.scheduler
    assert sched.lr_warmup_steps == pytest.approx(2.0) and sched.lr_decay_steps == 10
    assert (sched.start_wd, sched.end_wd, sched.wd_incr_style) == (0.0, 0.1, "linear")
    assert sched.override_opt_param_scheduler and not sched.use_checkpoint_opt_param_scheduler
    # the weight decay grows linearly over the decay steps; the QK layernorms get it with the flag
    trainer.train_step(toy_samples(2, seed=2), toy_pg_loss)
    groups = [g for o in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
              for g in o.optimizer.param_groups]
    # step 2 of 10 (the scheduler starts at step 1); norms and biases keep none, except the QK layernorms
    assert {round(g["weight_decay"], 6) for g in groups} == {0.0, 0.02}
    q_norm = trainer.gpt_model.decoder.layers[0].self_attention.q_layernorm.weight
    assert [round(g["weight_decay"], 6) for g in groups if any(p is q_norm for p in g["params"])] == [0.02]
    # the overlapped reduce gives the loss, gradient norm and update of the plain one
    samples = toy_samples(4, seed=3)
    runs = []
    for options in ((), (("overlap_grad_reduce", True), ("ddp_bucket_size", 1000))):
        run = hf_trainer(path, lr=1e-3, micro_batch_size=1, megatron_options=options)
        metrics = run.train_step(samples, toy_pg_loss)
        runs.append((metrics["loss"], metrics["grad_norm"], [p.detach().clone() for p in run.gpt_model.parameters()]))
    assert runs[0][:2] == pytest.approx(runs[1][:2], rel=1e-6)
    for a, b in zip(runs[0][2], runs[1][2]):
        torch.testing.assert_close(a, b)


def test_samples_become_optimizer_steps_of_one_global_batch(tmp_path):
    from relax.backends.megatron.optim import build_scheduler

    ensure_single_process()
    path = build_random_tiny_model(tmp_path / "m", "qwen2", seed=1)
    trainer = hf_trainer(path, lr=1e-3)
    _, settings = _settings(tmp_path, "--global-batch-size", "8", "--lr-decay-samples", "80", "--lr-warmup-samples",
                            "16", "--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "40", "--lr-wsd-decay-style",
                            "linear")
    from relax.backends.megatron.megatron_options import scheduler_fields

    sched = build_scheduler(trainer.optimizer, lr=1e-3, min_lr=0.0, lr_decay_style="WSD", lr_warmup_iters=0,
                            lr_decay_iters=None, lr_warmup_init=0.0, weight_decay=0.0,
                            **scheduler_fields(settings.megatron_options))
    assert (sched.lr_warmup_steps, sched.lr_decay_steps, sched.wsd_decay_steps) == (2, 10, 5)
    assert sched.lr_wsd_decay_style == "linear"
    assert sched.get_lr({"max_lr": 1e-3, "min_lr": 0.0}) == 0.0  # step 0 of the warm-up
    sched.step(increment=4)  # the stable phase (the decay is the last 5 of 10 steps)
    assert sched.get_lr({"max_lr": 1e-3, "min_lr": 0.0}) == pytest.approx(1e-3)
    sched.step(increment=3)  # 2 of the 5 decay steps done, linear
    assert sched.get_lr({"max_lr": 1e-3, "min_lr": 0.0}) == pytest.approx(1e-3 * 3 / 5)


def test_init_and_decoupled_lr_change_the_model_and_its_param_groups(tmp_path):
    from relax.backends.megatron.trainer import MegatronTrainer, TrainerSettings

    ensure_single_process()
    arch = hf_arch(build_random_tiny_model(tmp_path / "m", "qwen2", seed=1))
    stds = {}
    for std in (0.02, 0.5):
        _, settings = _settings(tmp_path, "--init-method-std", str(std), "--decoupled-lr", "0.5",
                                "--decoupled-min-lr", "0.1")
        trainer = MegatronTrainer(arch, TrainerSettings(lr=1e-3, megatron_options=settings.megatron_options))
        weight = trainer.gpt_model.decoder.layers[0].mlp.linear_fc1.weight
        stds[std] = float(weight.detach().float().std())
        groups = [g for o in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
                  for g in o.optimizer.param_groups]
        assert {g["max_lr"] for g in groups} == {1e-3, 0.5}  # the embedding and output layer get --decoupled-lr
        assert {g["min_lr"] for g in groups} == {0.0, 0.1}
    assert stds[0.02] == pytest.approx(0.02, rel=0.2) and stds[0.5] == pytest.approx(0.5, rel=0.2)
    # Xavier's uniform init: within +-sqrt(6 / (fan_in + fan_out)), and about that bound / sqrt(3) in std
    _, xavier = _settings(tmp_path, "--init-method-xavier-uniform")
    trainer = MegatronTrainer(arch, TrainerSettings(lr=1e-3, megatron_options=xavier.megatron_options))
    weight = trainer.gpt_model.decoder.layers[0].mlp.linear_fc1.weight.detach().float()
    bound = (6.0 / sum(weight.shape)) ** 0.5
    assert float(weight.abs().max()) <= bound and float(weight.std()) == pytest.approx(bound / 3**0.5, rel=0.2)


def test_fp16_loss_scale_flags_build_megatrons_scaler(tmp_path):
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

    ensure_single_process()
    path = build_random_tiny_model(tmp_path / "m", "qwen2", seed=1)
    _, constant = _settings(tmp_path, "--fp16", "--loss-scale", "128")
    trainer = hf_trainer(path, lr=1e-3, fp16=True, megatron_options=constant.megatron_options)

    def scalers(trainer):
        return [o.grad_scaler for o in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])]

    assert all(isinstance(s, ConstantGradScaler) and float(s.scale) == 128 for s in scalers(trainer))
    _, dynamic = _settings(tmp_path, "--fp16", "--initial-loss-scale", "1024", "--min-loss-scale", "4")
    trainer = hf_trainer(path, lr=1e-3, fp16=True, megatron_options=dynamic.megatron_options)
    assert all(isinstance(s, DynamicGradScaler) and float(s.scale) == 1024 and float(s.min_scale) == 4
               for s in scalers(trainer))
    # the flag's default is Megatron's 2**32
    assert all(float(s.scale) == 2.0**32 for s in scalers(hf_trainer(path, lr=1e-3, fp16=True)))


def test_moe_load_balancing_losses_change_the_router_gradients(tmp_path):
    ensure_single_process()
    path = build_random_tiny_moe_model(tmp_path / "moe", seed=4)
    samples = toy_samples(2, seed=5)
    grads = {}
    for flags in ([], ["--moe-aux-loss-coeff", "0.5"], ["--moe-z-loss-coeff", "0.5"]):
        _, settings = _settings(tmp_path, *flags)
        trainer = hf_trainer(path, lr=0.0, micro_batch_size=2, megatron_options=settings.megatron_options)
        if flags:
            assert trainer.config.moe_router_load_balancing_type == "aux_loss"
        trainer.train_step(samples, toy_pg_loss)
        router = trainer.gpt_model.decoder.layers[0].mlp.router.weight
        grads[tuple(flags)] = router.main_grad.detach().clone()
    plain = grads[()]
    assert not torch.allclose(plain, grads[("--moe-aux-loss-coeff", "0.5")])
    assert not torch.allclose(plain, grads[("--moe-z-loss-coeff", "0.5")])


def test_process_switches_and_the_param_group_dump(tmp_path, monkeypatch):
    import megatron.core.config as mcore_config
    import megatron.core.jit as mcore_jit

    ensure_single_process()
    path = build_random_tiny_model(tmp_path / "m", "qwen2", seed=1)
    dump = tmp_path / "groups.json"
    _, settings = _settings(tmp_path, "--enable-experimental", "--disable-jit-fuser",
                            "--dump-param-to-param-group-map", str(dump))
    monkeypatch.setattr(mcore_config, "ENABLE_EXPERIMENTAL", False)
    monkeypatch.setattr(mcore_jit, "jit_fuser", mcore_jit.jit_fuser)
    hf_trainer(path, lr=1e-3, megatron_options=settings.megatron_options)
    assert mcore_config.is_experimental_enabled()
    assert mcore_jit.jit_fuser is mcore_jit.noop_decorator
    assert dump.is_dir() and any(dump.iterdir())  # a torch.distributed.checkpoint of each parameter's group


def test_no_save_rng_and_no_load_rng(tmp_path):
    ensure_single_process()
    path = build_random_tiny_model(tmp_path / "m", "qwen2", seed=1)
    _, no_save = _settings(tmp_path, "--no-save-rng")
    _, no_load = _settings(tmp_path, "--no-load-rng")
    trainer = hf_trainer(path, lr=1e-3, megatron_options=no_save.megatron_options)
    trainer.save_checkpoint(tmp_path / "ck")
    # a checkpoint without RNG state asks for --no-load-rng, as Megatron-LM does
    with pytest.raises(ValueError, match="--no-load-rng"):
        hf_trainer(path, lr=1e-3).load_checkpoint(tmp_path / "ck")
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    assert hf_trainer(path, lr=1e-3, megatron_options=no_load.megatron_options).load_checkpoint(tmp_path / "ck") == 0
    # building a trainer reseeds (Megatron's seeding); with --no-load-rng the load leaves that state alone
    trainer2 = hf_trainer(path, lr=1e-3, megatron_options=no_load.megatron_options)
    torch.manual_seed(7)
    trainer2.load_checkpoint(tmp_path / "ck")
    assert torch.equal(torch.rand(3), expected)
    # saved with RNG (the default), loading restores the state it had at the save
    with_rng = hf_trainer(path, lr=1e-3)
    torch.manual_seed(11)
    with_rng.save_checkpoint(tmp_path / "ck2")
    after_save = torch.rand(3)
    torch.manual_seed(99)
    with_rng.load_checkpoint(tmp_path / "ck2")
    assert torch.equal(torch.rand(3), after_save)


_CALLS: list[str] = []


def spec_function():
    """A --spec target: Relax's own local layer spec of the qwen2 test model, recording the call."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    _CALLS.append("spec")
    return get_gpt_layer_local_spec(qk_layernorm=False, normalization="RMSNorm")


def provider(pre_process, post_process, vp_stage=None, config=None, arch=None):
    """A --custom-model-provider-path target: Relax's own model, recording the call."""
    from relax.backends.megatron.model import build_gpt_model

    _CALLS.append("provider")
    return build_gpt_model(arch, config, False, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)


def test_spec_transformer_impl_and_custom_model_provider_build_the_model(tmp_path):
    ensure_single_process()
    path = build_random_tiny_model(tmp_path / "m", "qwen2", seed=1)
    samples = toy_samples(2, seed=2)
    expected = hf_trainer(path, lr=1e-3).compute_logprobs(samples)
    cases = [(["--spec", "local"], None), (["--transformer-impl", "local"], None),
             (["--spec", "test_megatron_options", "spec_function"], "spec"),
             (["--custom-model-provider-path", "test_megatron_options.provider"], "provider")]
    for flags, call in cases:
        _CALLS.clear()
        _, settings = _settings(tmp_path, *flags)
        trainer = hf_trainer(path, lr=1e-3, megatron_options=settings.megatron_options)
        assert trainer.settings.use_te is (False if call is None else None)
        assert _CALLS == ([call] if call else [])
        for a, b in zip(expected, trainer.compute_logprobs(samples)):
            torch.testing.assert_close(a, b)
    assert unsupported_flags(parse_config(["--output-dir", str(tmp_path), "--transformer-impl",
                                           "inference_optimized"])) == ["--transformer-impl inference_optimized"]


def test_ddp_num_buckets_and_the_weight_hash_check(tmp_path, monkeypatch):
    import relax.backends.megatron.megatron_options as backend_options

    ensure_single_process()
    path = build_random_tiny_model(tmp_path / "m", "qwen2", seed=1)
    _, settings = _settings(tmp_path, "--overlap-grad-reduce", "--ddp-num-buckets", "4",
                            "--check-weight-hash-across-dp-replicas-interval", "2")
    trainer = hf_trainer(path, lr=1e-3, megatron_options=settings.megatron_options)
    assert trainer.model.ddp_config.bucket_size == sum(p.numel() for p in trainer.gpt_model.parameters()) // 4
    checked = []
    monkeypatch.setattr(backend_options, "check_param_hashes_across_dp_replicas",
                        lambda model, cross_check: checked.append(cross_check) or len(checked) < 2)
    trainer.train_step(toy_samples(2, seed=1), toy_pg_loss)
    assert checked == []  # optimizer step 1 of an interval of 2
    trainer.train_step(toy_samples(2, seed=2), toy_pg_loss)
    assert checked == [True]
    trainer.train_step(toy_samples(2, seed=3), toy_pg_loss)
    with pytest.raises(RuntimeError, match="differ across data-parallel replicas after optimizer step 4"):
        trainer.train_step(toy_samples(2, seed=4), toy_pg_loss)


def test_process_group_options_reach_initialize_model_parallel(tmp_path, monkeypatch):
    from megatron.core import parallel_state as ps

    from relax.backends.megatron.megatron_options import parallel_fields
    from relax.backends.megatron.parallel import init_model_parallel

    _, settings = _settings(tmp_path, "--use-tp-pp-dp-mapping", "--disable-gloo-process-groups")
    fields = parallel_fields(settings.megatron_options)
    assert fields == {"order": "tp-cp-ep-pp-dp", "create_gloo_process_groups": False}
    ensure_single_process()
    seen = {}
    monkeypatch.setattr(ps, "model_parallel_is_initialized", lambda: False)
    monkeypatch.setattr(ps, "initialize_model_parallel", lambda **kwargs: seen.update(kwargs))
    monkeypatch.setattr("relax.backends.megatron.parallel.layout", lambda: None)
    init_model_parallel(1, 1, seed=None, **fields)
    assert seen["order"] == "tp-cp-ep-pp-dp" and seen["create_gloo_process_groups"] is False


def test_a_trainer_without_gloo_groups_trains(tmp_path):
    """--disable-gloo-process-groups: Megatron creates no gloo groups, and the (distributed) optimizer uses none."""
    from megatron.core import parallel_state as ps

    from relax.backends.megatron.parallel import destroy, init_distributed

    ensure_single_process()
    path = build_random_tiny_model(tmp_path / "m", "qwen2", seed=1)
    _, settings = _settings(tmp_path, "--disable-gloo-process-groups")
    destroy()
    from relax.backends.megatron.testing import _free_port

    init_distributed(0, 1, "127.0.0.1", _free_port(), backend="gloo")
    try:
        trainer = hf_trainer(path, lr=1e-3, use_distributed_optimizer=True, megatron_options=settings.megatron_options)
        assert ps._DATA_PARALLEL_GROUP_GLOO is None
        assert trainer.train_step(toy_samples(2, seed=1), toy_pg_loss)["grad_norm"] > 0
    finally:
        destroy()
        ensure_single_process()


def test_exit_on_missing_checkpoint_stops_before_ray(tmp_path):
    base = ["--output-dir", str(tmp_path), "--load", str(tmp_path / "ckpt")]
    with pytest.raises(ConfigError, match="holds no checkpoint .*--exit-on-missing-checkpoint"):
        parse_config(base + ["--exit-on-missing-checkpoint"])
    parse_config(base)  # without the flag a fresh --load starts from the initial weights
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("3")
    assert unsupported_flags(parse_config(base + ["--exit-on-missing-checkpoint"])) == []


def _dp_random_init_rank(rank, world, path):
    from relax.backends.megatron.trainer import MegatronTrainer, TrainerSettings

    out = {}
    for name, options in (("plain", ()), ("seeded", (("data_parallel_random_init", True),))):
        trainer = MegatronTrainer(hf_arch(path), TrainerSettings(lr=1e-3, megatron_options=options))
        out[name] = {"weight": trainer.gpt_model.decoder.layers[0].mlp.linear_fc1.weight.detach().clone(),
                     "draw": torch.rand(4)}
    return out


def test_data_parallel_random_init_seeds_each_rank_and_broadcasts_the_weights(tmp_path):
    """--data-parallel-random-init on DP 2 over gloo: each rank its own seed (its random stream differs), the same
    weights on both (the first rank's, broadcast), as Megatron-LM does."""
    from relax.backends.megatron.testing import run_ranks

    path = build_random_tiny_model(tmp_path / "m", "qwen2", seed=1)
    ranks = run_ranks(_dp_random_init_rank, 2, str(path), timeout=240)
    plain, seeded = [r["plain"] for r in ranks], [r["seeded"] for r in ranks]
    assert torch.equal(plain[0]["draw"], plain[1]["draw"])  # one seed for every data-parallel rank
    assert not torch.equal(seeded[0]["draw"], seeded[1]["draw"])
    # rank 1 initialised from its own seed, then took rank 0's weights (rank 0's seed is the plain one)
    assert torch.equal(seeded[0]["weight"], seeded[1]["weight"])
    assert torch.equal(seeded[1]["weight"], plain[0]["weight"])
