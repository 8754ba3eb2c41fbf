"""LoRA trained on the trainer, served by real SGLang on CPU (the SGLang venv of tests/test_sglang_cpu.py; skipped with
the install hint where it is absent).

- merged sync (--lora-merge-sync): each push moves `W + alpha / r * B @ A` through the normal weight push
  (relax.weights.sync.push_for_config); after each of two pushes (the adapters changed between them) the engine's
  log-probs of a fixed batch equal the trainer's within 1e-5 (fp32) and differ from the base's.
- adapter-only sync: SGLang launched with LoRA (--enable-lora, torch_native backend on CPU), each push writes the
  PEFT folder and loads it with /load_lora_adapter (relax.backends.megatron.lora_sync.push_adapter); requests
  naming it (`lora_path`) get the trainer's log-probs within 1e-5 after each of two pushes, requests naming none
  the base's.
- the same through the controller (e2e): `--rollout-backend sglang --lora-rank 8`, two GRPO steps; the engines are
  launched with LoRA by the rollout role (relax.roles.engine.lora_server_args), the rollout's requests name the
  adapter, and afterwards the engine's log-probs equal the trainer's within 1e-5.
"""

from __future__ import annotations

import time

import pytest
import torch

from relax.backends.megatron.lora import LoraSettings
from relax.backends.megatron.testing import hf_trainer, toy_pg_loss, toy_samples
from relax.wire.engine_client import EngineClient
from test_sglang_cpu import SGLANG_PY, SKIP_MSG, START_TIMEOUT_S, sglang_ray  # noqa: F401  (a fixture)

RANDOM_MODEL = dict(seed=7, intermediate_size=192)  # the module's model_dir (tests/conftest.py); SGLang pads the MLP
# to a multiple of 64 on CPU, and its LoRA buffers then do not fit an adapter of the unpadded size (176)
PROMPTS = [[12, 34, 56, 78, 90, 11], [5, 6, 7, 8]]
TEMPERATURE = 1.0
TOL = 1e-5
SETTINGS = dict(lr=2e-2, micro_batch_size=2, seed=3)


def _start(model_dir, log, extra=None):
    from relax.backends.sglang.server import SGLangServerProcess

    if SGLANG_PY is None:
        pytest.skip(SKIP_MSG)
    proc = SGLangServerProcess(model_dir, python=SGLANG_PY, log_path=str(log),
                               server_args={"random_seed": 0, "device": "cpu", "max_total_tokens": 4096,
                                            **(extra or {})})
    t0 = time.monotonic()
    proc.start()
    try:
        proc.wait_healthy(START_TIMEOUT_S)
    except BaseException:
        proc.stop()
        raise
    print(f"\nSGLang CPU server healthy in {time.monotonic() - t0:.1f} s")
    return proc


@pytest.fixture(scope="module")
def sglang_server(model_dir, tmp_path_factory):
    proc = _start(model_dir, tmp_path_factory.mktemp("sglang_lora_log") / "server.log")
    try:
        yield proc
    finally:
        proc.stop()


def _engine_rows(url, lora=None):
    """(prompt + reply tokens, reply length, the engine's log-probs of the reply, weight version) for each of
    PROMPTS, one batched /generate; `lora`: SGLang's lora_path."""
    from relax.backends.embedded.testing import response_logprobs

    client = EngineClient(url, timeout_s=120)
    try:
        kw = {"lora_path": lora} if lora is not None else {}
        out = client.generate(PROMPTS, [{"temperature": TEMPERATURE, "max_new_tokens": 6, "ignore_eos": True,
                                         "sampling_seed": 11} for _ in PROMPTS], return_logprob=True, **kw)
    finally:
        client.close()
    return [(p + r["output_ids"], len(r["output_ids"]), response_logprobs(r), r["meta_info"].get("weight_version"))
            for p, r in zip(PROMPTS, out)]


def _diff(trainer, rows):
    want = trainer.compute_logprobs([{"tokens": torch.tensor(t), "response_length": n} for t, n, *_ in rows],
                                    TEMPERATURE)
    return max(max(abs(a - b) for a, b in zip(got, w.tolist())) for (_, _, got, _), w in zip(rows, want))


@pytest.mark.usefixtures("megatron_process")
def test_merged_lora_push_to_real_sglang_matches_the_trainer(sglang_server, model_dir):
    from relax.weights.sync import push_for_config

    trainer = hf_trainer(model_dir, **SETTINGS, lora=LoraSettings(rank=8, alpha=16.0, seed=3))
    base = hf_trainer(model_dir, **SETTINGS)
    samples = toy_samples(4, seed=4, vocab=300)
    diffs = []
    for version in (1, 2):
        trainer.train_step(samples, toy_pg_loss)
        t0 = time.perf_counter()
        push_for_config(list(trainer.export_hf_weights()), [sglang_server.url], version,
                        {})
        push_s = time.perf_counter() - t0
        rows = _engine_rows(sglang_server.url)
        assert all(str(v) == str(version) for *_, v in rows)
        diff, moved = _diff(trainer, rows), _diff(base, rows)
        print(f"\nmerged push v{version}: {push_s:.2f} s; engine vs trainer max |dlogp| {diff:.3g}, "
              f"vs base {moved:.3g}")
        diffs.append(diff)
        assert diff <= TOL, diff
        assert moved > 1e-3  # the adapters' change was pushed
    assert sglang_server.is_alive()


HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.usefixtures("megatron_process")
def test_adapter_only_push_to_real_sglang_matches_the_trainer(model_dir, tmp_path):
    """SGLang launched with LoRA (torch_native backend on CPU), the adapter loaded with /load_lora_adapter from the
    PEFT folder the trainer's push writes, requests naming it with `lora_path`."""
    from relax.backends.megatron.lora_sync import push_adapter

    proc = _start(model_dir, tmp_path / "server.log",
                  {"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": HF_TARGETS,
                   "lora_backend": "torch_native"})
    try:
        trainer = hf_trainer(model_dir, **SETTINGS, lora=LoraSettings(rank=8, alpha=16.0, seed=3))
        base = hf_trainer(model_dir, **SETTINGS)
        samples = toy_samples(4, seed=4, vocab=300)
        for version in (1, 2):
            trainer.train_step(samples, toy_pg_loss)
            t0 = time.perf_counter()
            report = push_adapter(trainer, [proc.url], tmp_path / "lora_push", version)
            push_s = time.perf_counter() - t0
            client = EngineClient(proc.url, timeout_s=60)
            assert str(client.get_weight_version()) == str(version)
            client.close()
            rows = _engine_rows(proc.url, "policy")
            diff, moved = _diff(trainer, rows), _diff(base, rows)
            base_diff = _diff(base, _engine_rows(proc.url))  # requests naming no adapter: the base
            print(f"\nadapter push v{version}: {push_s:.2f} s, {report['bytes']} B; engine vs trainer max |dlogp| "
                  f"{diff:.3g}, vs base {moved:.3g}; no adapter vs base {base_diff:.3g}")
            assert diff <= TOL, diff
            assert moved > 1e-3
            assert base_diff <= TOL, base_diff
    finally:
        proc.stop()


@pytest.mark.e2e
def test_adapter_only_sync_to_real_sglang_through_the_controller(model_dir, tmp_path, sglang_ray):  # noqa: F811
    import json

    import ray

    from relax.backends.embedded.testing import response_logprobs
    from relax.config import parse_config
    from relax.config.rules_lora import ADAPTER_NAME
    from relax.core.controller import Controller
    from relax.models.tasks import generate_task_dataset

    data = generate_task_dataset(tmp_path / "train.jsonl", 16, seed=0, task="add_mod10")
    out = tmp_path / "run"
    config = parse_config([
        "--hf-checkpoint", str(model_dir), "--prompt-data", str(data), "--apply-chat-template", "--input-key",
        "input", "--label-key", "label", "--rm-type", "random", "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "4", "--num-rollout", "2", "--rollout-max-response-len", "4",
        "--micro-batch-size", "4", "--lr", "2e-2", "--lr-decay-style", "constant",
        "--resource", '{"actor": [1, 1], "rollout": [1, 1]}', "--num-data-storage-units", "1",
        "--output-dir", str(out), "--distributed-backend", "gloo", "--rollout-backend", "sglang",
        "--lora-rank", "8", "--get-mismatch-metrics", "--custom-tis-function-path", "test_lora_e2e.no_correction",
    ])
    controller = Controller(config)
    try:
        controller.start()
        controller.run()
        client = EngineClient(controller.engine_urls[0], timeout_s=120)
        assert str(client.get_weight_version()) == "2"
        sampling = [{"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True} for _ in PROMPTS]
        lora = client.generate(PROMPTS, sampling, return_logprob=True, lora_path=ADAPTER_NAME)
        base = client.generate(PROMPTS, sampling, return_logprob=True)
        client.close()
        tokens = [p + r["output_ids"] for p, r in zip(PROMPTS, lora)]
        lengths = [len(r["output_ids"]) for r in lora]
        trainer = ray.get(controller.workers[0].compute_logprobs.remote(tokens, lengths, 1.0))
        diff = max(abs(a - b) for r, t in zip(lora, trainer) for a, b in zip(response_logprobs(r), t))
        base_tokens = [p + r["output_ids"] for p, r in zip(PROMPTS, base)]
        trained_on_base = ray.get(controller.workers[0].compute_logprobs.remote(
            base_tokens, [len(r["output_ids"]) for r in base], 1.0))
        moved = max(abs(a - b) for r, t in zip(base, trained_on_base) for a, b in zip(response_logprobs(r), t))
        print(f"\ncontroller, adapter-only sync to SGLang: engine vs trainer max |dlogp| {diff:.3g}; "
              f"the engine's base vs the trainer {moved:.3g}")
        assert diff <= TOL, diff
        assert moved > 1e-4  # the adapter's change: requests naming none get the base, not the trained policy
    finally:
        controller.shutdown()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    # the rollout's requests named the adapter after the first push: the engine's log-probs are the trainer's
    for record in records:
        print(f"step {record['step']}: mismatch |dlogp| mean {record['train/mismatch_logprob_abs_diff_mean']:.3g}")
        assert record["train/mismatch_logprob_abs_diff_mean"] <= TOL, record
    assert all(r["perf/weight_sync_bytes"] < 200_000 for r in records)  # the adapter, not the model
