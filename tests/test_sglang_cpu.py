"""Real SGLang on CPU: the server Relax launches (SGLangServerProcess), driven by EngineClient.

Runs only where a separate SGLang venv exists (Relax's own venv never holds SGLang): the interpreter
named by $RELAX_SGLANG_PYTHON, else <repo>/.venv-sglang/bin/python. Install it with
`bash scripts/install_sglang_cpu.sh` (1.5 GB, 1.5-3.5 min; see docs/sglang-cpu.md).

- generation with log-probs equal to a transformers forward pass (greedy and sampled, batched);
- a weight update from tensors (begin/end_weight_update, shared memory) changes the outputs, and the
  log-probs then equal those of the new weights; the weight version follows;
- a few GRPO steps through the controller with `--rollout-backend sglang`, on the tests' shared Ray cluster
  started again with the SGLang interpreter in its environment (`sglang_ray`, also used by
  tests/test_sglang_fault_tolerance.py).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from relax.wire.auth import ensure_engine_api_key
from relax.wire.engine_client import EngineClient

ROOT = Path(__file__).resolve().parents[1]


def _sglang_python() -> str | None:
    for cand in (os.environ.get("RELAX_SGLANG_PYTHON"), str(ROOT / ".venv-sglang" / "bin" / "python")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


SGLANG_PY = _sglang_python()
SKIP_MSG = ("no SGLang venv: install it with `bash scripts/install_sglang_cpu.sh` (creates .venv-sglang) "
            "or point RELAX_SGLANG_PYTHON at a Python that has sglang (docs/sglang-cpu.md)")


def _require_sglang() -> None:
    if SGLANG_PY is None:
        pytest.skip(SKIP_MSG)


@pytest.fixture(scope="module")
def sglang_ray():
    """The tests' shared Ray cluster (conftest.shared_ray), started afresh with $RELAX_SGLANG_PYTHON set in this
    process, whose environment the cluster's workers inherit: every engine actor, also one the rollout manager
    starts later to replace another, launches SGLang from the SGLang venv. A cluster started earlier in the session
    lacks it (a skip here used to make CI skip the controller test). Shut down at the end: later tests get a
    cluster without it (tests/test_router_sglang_launcher.py expects no SGLang)."""
    import ray

    from conftest import shared_ray
    from relax.backends.sglang.server import SGLANG_PYTHON_ENV

    _require_sglang()
    ray.shutdown()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(SGLANG_PYTHON_ENV, SGLANG_PY)
        shared_ray()
        try:
            yield
        finally:
            ray.shutdown()


PROMPTS = [
    [257, 84, 82, 68, 81, 198, 18, 10, 19, 28, 258, 198, 257, 64],
    [257, 84, 82, 68, 81, 198, 21, 10, 23, 28, 258, 198, 257, 64, 82, 82],
]
TOL = 1e-4
START_TIMEOUT_S = 600


# ---------------------------------------------------------------------------------------------
# Launch arguments and shims (no SGLang needed)

def test_cpu_launch_defaults_env_and_python(monkeypatch):
    from relax.backends.sglang import server as srv

    monkeypatch.setattr(srv, "_cuda_available", lambda: False)
    monkeypatch.setenv("RELAX_SGLANG_PYTHON", "/opt/sglang/bin/python")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    p = srv.SGLangServerProcess("/m", port=30123, server_args={"max_total_tokens": 1024},
                                env={"PYTHONPATH": "/x"}, exit_with_parent=False)
    assert p.on_cpu and p.python == "/opt/sglang/bin/python" and p.cmd[0] == "/opt/sglang/bin/python"
    cli = p.cmd[p.cmd.index("--tp-size") + 2:]
    assert cli[:6] == ["--device", "cpu", "--dtype", "float32", "--max-total-tokens", "1024"]  # given value wins
    assert cli[6] == f"--api-key={ensure_engine_api_key()}"  # the run's key guards control endpoints
    assert p.env["PYTHONPATH"].split(os.pathsep) == [srv.CPU_SHIMS_DIR, "/x"]
    assert p.env["SGLANG_USE_CPU_ENGINE"] == "0" and p.env["OMP_NUM_THREADS"] == "1"
    # python= beats the environment variable; a GPU device keeps the arguments and env untouched
    monkeypatch.setattr(srv, "_cuda_available", lambda: True)
    p = srv.SGLangServerProcess("/m", port=30123, server_args={"random_seed": 1}, python="/usr/bin/python3")
    assert not p.on_cpu and p.server_args == {"random_seed": 1} and p.env is None
    assert "/usr/bin/python3" in p.cmd and "--device" not in p.cmd
    p = srv.SGLangServerProcess("/m", port=30123, server_args={"device": "cpu", "dtype": "bfloat16"})
    assert p.on_cpu and p.cmd[p.cmd.index("--dtype") + 1] == "bfloat16"


def test_a_taken_port_ends_the_wait_at_once(tmp_path, monkeypatch):
    """SGLang 0.5.23 whose port was taken logs uvicorn's bind error and then hangs instead of exiting (seen in a
    run: an engine start then waited out its 300 s start timeout before the retry on another port). The wait ends
    at the error; an earlier start's error in the same (appended) log does not count."""
    from relax.backends.sglang import server as srv

    monkeypatch.setattr(srv, "_cuda_available", lambda: False)
    log = tmp_path / "engine-1.log"
    line = "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 33271): address already in use"
    p = srv.SGLangServerProcess("/m", server_args={}, log_path=str(log), exit_with_parent=False)
    p.cmd = ["sh", "-c", f"echo \"{line}\"; echo 'INFO:     Waiting for application shutdown.'; exec sleep 60"]
    t0 = time.monotonic()
    p.start()
    try:
        with pytest.raises(RuntimeError, match=f"could not bind port {p.port}: address already in use"):
            p.wait_healthy(60)
        assert time.monotonic() - t0 < 15 and p.is_alive()  # found in the log, while the process still hangs
    finally:
        p.stop()
    # the next start appends to the same log: only its own output counts (here: none, so the wait times out)
    p = srv.SGLangServerProcess("/m", server_args={}, log_path=str(log), exit_with_parent=False)
    p.cmd = ["sleep", "60"]
    p.start()
    try:
        with pytest.raises(RuntimeError, match="did not answer 2xx within 2.0s") as err:
            p.wait_healthy(2)
        assert "could not bind" not in str(err.value) and not p.bind_failed()
    finally:
        p.stop()


def test_cpu_shims_import_in_a_plain_interpreter():
    """The stubs load without SGLang; the triton stand-in only appears where sglang is installed."""
    import subprocess
    import sys

    from relax.backends.sglang.server import CPU_SHIMS_DIR

    code = (
        "import importlib.util, torchvision, torchvision.transforms.functional as F\n"
        "from torchvision.transforms import InterpolationMode\n"
        "from vllm._custom_ops import rotary_embedding\n"
        "from IPython.display import HTML, display\n"
        "assert torchvision.__relax_stub__ and InterpolationMode.BILINEAR is not None\n"
        "try:\n    InterpolationMode()\nexcept RuntimeError as e:\n    assert 'stub' in str(e)\n"
        "else:\n    raise AssertionError('a stub must not be usable')\n"
        "try:\n    import vllm.logger\nexcept ImportError:\n    pass\n"
        "else:\n    raise AssertionError('only vllm._custom_ops exists')\n"
        "if importlib.util.find_spec('sglang') is None:\n"
        "    import sys; assert 'triton' not in sys.modules\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=CPU_SHIMS_DIR)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# ---------------------------------------------------------------------------------------------
# Real SGLang on CPU

# model_dir: the session's tiny model (conftest), which these tests only read

@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    from relax.backends.sglang.server import SGLangServerProcess

    _require_sglang()
    log = tmp_path_factory.mktemp("sglang_cpu_log") / "server.log"
    proc = SGLangServerProcess(model_dir, python=SGLANG_PY, server_args={"random_seed": 0, "device": "cpu",
                                                                        "max_total_tokens": 4096},
                               log_path=str(log))
    assert proc.on_cpu and "--dtype" in proc.cmd and "float32" in proc.cmd
    t0 = time.monotonic()
    proc.start()
    try:
        proc.wait_healthy(START_TIMEOUT_S)
        print(f"\nSGLang CPU server healthy in {time.monotonic() - t0:.1f} s")
        client = EngineClient(proc.url, timeout_s=120)
        yield proc, client
        client.close()
    finally:
        proc.stop()
    assert not proc.is_alive()


def _hf_model(model_dir, state_dict=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model.eval()


@torch.no_grad()
def _hf_logprobs(model, prompt, output_ids):
    """log p(output_ids[i] | prompt + output_ids[:i]) and the greedy token at each position."""
    ids = torch.tensor([list(prompt) + list(output_ids)])
    logits = model(ids).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    out = torch.tensor(output_ids)
    return logp.gather(1, out[:, None])[:, 0].tolist(), logp.argmax(-1).tolist()


def _check_against_hf(client, model, prompts, sampling) -> list[list[int]]:
    replies = client.generate(prompts, [dict(sampling) for _ in prompts], return_logprob=True)
    assert isinstance(replies, list) and len(replies) == len(prompts)
    outs = []
    for prompt, reply in zip(prompts, replies):
        pairs = reply["meta_info"]["output_token_logprobs"]
        ids, engine_lp = [p[1] for p in pairs], [p[0] for p in pairs]
        assert ids == reply["output_ids"] and len(ids) == sampling["max_new_tokens"]
        hf_lp, hf_greedy = _hf_logprobs(model, prompt, ids)
        diff = max(abs(a - b) for a, b in zip(engine_lp, hf_lp))
        assert diff < TOL, (diff, engine_lp, hf_lp)
        if sampling.get("temperature") == 0.0:
            assert ids == hf_greedy, (ids, hf_greedy)
        outs.append(ids)
    return outs


def test_generate_logprobs_match_hf_and_weight_update(server, model_dir):
    proc, client = server
    assert client.health_generate()
    assert client.get_weight_version() == "default"
    # requests in flight, as the fault injection and the pool's drain read them (SGLang 0.5.23: /v1/loads only)
    assert client.num_requests() == 0
    busy = threading.Thread(target=client.generate, args=(PROMPTS * 4, {"max_new_tokens": 256, "ignore_eos": True}))
    busy.start()
    seen, probe = 0, EngineClient(proc.url, timeout_s=10)
    while busy.is_alive() and not seen:
        seen = probe.num_requests()
        time.sleep(0.02)
    busy.join()
    deadline = time.monotonic() + 10  # SGLang's load snapshot may lag its last step a little
    while probe.num_requests() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert seen > 0 and probe.num_requests() == 0
    probe.close()
    model = _hf_model(model_dir)
    greedy = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
    sampled = {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 7}
    before = _check_against_hf(client, model, PROMPTS, greedy)
    _check_against_hf(client, model, PROMPTS, sampled)
    # greedy is deterministic
    assert _check_against_hf(client, model, PROMPTS[:1], greedy) == before[:1]

    # new weights: every tensor perturbed (names as Hugging Face writes them)
    gen = torch.Generator().manual_seed(1)
    new_sd = {k: v + 0.5 * v.std().clamp_min(1e-3) * torch.randn(v.shape, generator=gen)
              for k, v in model.state_dict().items()}
    stats = client.update_weights_from_tensor(list(new_sd.items()), weight_version="v1")
    print(f"\nweight update: {stats}")
    assert stats["num_tensors"] == len(new_sd)
    assert client.get_weight_version() == "v1"
    new_model = _hf_model(model_dir, new_sd)
    after = _check_against_hf(client, new_model, PROMPTS, greedy)
    assert after != before, "the weight update did not change the greedy outputs"
    _check_against_hf(client, new_model, PROMPTS, sampled)

    # a second update back to the original weights restores the original outputs
    client.update_weights_from_tensor(list(model.state_dict().items()), weight_version="v2")
    assert client.get_weight_version() == "v2"
    assert _check_against_hf(client, model, PROMPTS, greedy) == before
    assert proc.is_alive()


def test_grpo_steps_through_controller_with_sglang_backend(model_dir, tmp_path, sglang_ray):
    import json

    import ray

    from relax.config import parse_config
    from relax.core.controller import Controller
    from relax.models.tasks import generate_task_dataset

    data = generate_task_dataset(tmp_path / "train.jsonl", 16, seed=0, task="add_mod10")
    out = tmp_path / "run"
    config = parse_config([
        "--hf-checkpoint", model_dir, "--prompt-data", str(data), "--apply-chat-template", "--input-key", "input",
        "--label-key", "label", "--rm-type", "random", "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "4", "--num-rollout", "2", "--rollout-max-response-len", "4",
        "--micro-batch-size", "4", "--lr", "1e-3", "--lr-decay-style", "constant",
        "--resource", '{"actor": [1, 1], "rollout": [1, 1]}', "--num-data-storage-units", "1",
        "--output-dir", str(out), "--distributed-backend", "gloo", "--rollout-backend", "sglang",
    ])
    controller = Controller(config)
    try:
        controller.start()
        assert len(controller.engine_urls) == 1
        controller.run()
        client = EngineClient(controller.engine_urls[0], timeout_s=120)
        assert str(client.get_weight_version()) == "2"
        # The SGLang engine serves the trainer's weights: its log-probs equal the trainer's.
        prompt = PROMPTS[0]
        reply = client.generate(prompt, {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True},
                                return_logprob=True)
        pairs = reply["meta_info"]["output_token_logprobs"]
        ids, engine_lp = [p[1] for p in pairs], [p[0] for p in pairs]
        trainer_lp = ray.get(controller.workers[0].compute_logprobs.remote([prompt + ids], [len(ids)], 1.0))[0]
        assert len(trainer_lp) == len(engine_lp) == 8
        assert max(abs(a - b) for a, b in zip(trainer_lp, engine_lp)) < TOL, (trainer_lp, engine_lp)
    finally:
        controller.shutdown()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["rollout/num_samples"] == 8.0 and r["train/grad_norm"] > 0 for r in records)
