"""On-policy distillation with an SGLang-API teacher (--use-opd --opd-type sglang --rm-url URL).

1. Request/reply format and its checks (no server).
2. Against a real embedded engine server holding the teacher: the HTTP teacher's log-probs equal the Megatron
   log-probs of the same weights within 1e-4 (temperature 1 and 0.7).
3. End to end through the controller (real Ray, Megatron over gloo, an embedded rollout engine, TransferQueue):
   2 steps with the teacher server; finite losses, an OPD metric that is not 0 (the teacher differs from the
   student), the teacher timing metric.
4. Parse rules and support status.
"""

import math

import pytest
import torch

from relax.backends.embedded.launcher import EmbeddedServerProcess
from relax.config import parse_config
from relax.config.errors import ConfigError
from relax.models.tasks import generate_task_dataset
from relax.models.tiny import TinyArch, build_tiny_model_dir
from relax.rollout.teacher_client import (
    SGLangTeacher,
    TeacherError,
    normalize_url,
    parse_teacher_logprobs,
    teacher_logprobs_request,
)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    base = tmp_path_factory.mktemp("opd_sglang")
    student = build_tiny_model_dir(base / "student", TinyArch(family="qwen2"), seed=0)
    teacher = build_tiny_model_dir(base / "teacher", TinyArch(family="qwen2"), seed=1)
    data = generate_task_dataset(base / "train.jsonl", 16, seed=0, task="add_mod10")
    return base, str(student), str(teacher), str(data)


@pytest.fixture(scope="module")
def teacher_url(assets):
    proc = EmbeddedServerProcess(assets[2], server_args={"random_seed": 0, "dtype": "float32"})
    proc.start()
    try:
        proc.wait_healthy(120)
        yield proc.url
    finally:
        proc.stop()


def test_request_and_reply_format():
    pairs = [([5, 6, 7], [8, 9]), ([1], [2])]
    body = teacher_logprobs_request(pairs, temperature=0.5)
    assert body["input_ids"] == [[5, 6, 7, 8, 9], [1, 2]]
    assert body["logprob_start_len"] == [2, 0] and body["return_logprob"] is True
    assert body["sampling_params"]["max_new_tokens"] == 0 and body["sampling_params"]["temperature"] == 0.5
    reply = [{"meta_info": {"input_token_logprobs": [[-0.1, 7, None], [-0.2, 8, None], [-0.3, 9, None]]}},
             {"meta_info": {"input_token_logprobs": [[None, 1, None], [-0.4, 2, None]]}}]
    assert parse_teacher_logprobs(reply, pairs) == [[-0.2, -0.3], [-0.4]]
    bad = [dict(reply[0]), {"meta_info": {"input_token_logprobs": [[None, 1, None], [-0.4, 3, None]]}}]
    with pytest.raises(TeacherError, match="other tokens"):
        parse_teacher_logprobs(bad, pairs)
    with pytest.raises(TeacherError, match="2 samples"):
        parse_teacher_logprobs(reply[:1], pairs)
    with pytest.raises(ValueError):
        teacher_logprobs_request([([], [1])])
    assert normalize_url("127.0.0.1:30000/generate") == "http://127.0.0.1:30000"
    assert normalize_url("http://h:1/") == "http://h:1"


def test_unreachable_teacher_names_the_url():
    teacher = SGLangTeacher("127.0.0.1:9", retries=2, backoff_s=0.01, timeout_s=2)
    with pytest.raises(TeacherError, match="127.0.0.1:9/generate failed after 2"):
        teacher.score([([1, 2], [3])])


def test_http_teacher_matches_megatron_logprobs(assets, teacher_url):
    from transformers import AutoConfig

    from relax.formats.model_arch import ModelArch
    from relax.backends.megatron.testing import ensure_single_process
    from relax.backends.megatron.trainer import MegatronTrainer, TrainerSettings

    teacher_dir = assets[2]
    gen = torch.Generator().manual_seed(0)
    vocab = AutoConfig.from_pretrained(teacher_dir).vocab_size
    pairs = []
    for i in range(6):
        prompt = torch.randint(3, vocab, (4 + i,), generator=gen).tolist()
        response = torch.randint(3, vocab, (2 + (i * 3) % 7,), generator=gen).tolist()
        pairs.append((prompt, response))
    ensure_single_process()
    trainer = MegatronTrainer(ModelArch.from_hf_config(AutoConfig.from_pretrained(teacher_dir)),
                              TrainerSettings(forward_only=True, micro_batch_size=3))
    trainer.load_hf(teacher_dir)
    samples = [{"tokens": torch.tensor(p + r), "response_length": len(r)} for p, r in pairs]
    for temperature in (1.0, 0.7):
        http = SGLangTeacher(teacher_url, temperature=temperature, chunk_size=4).score(pairs)
        ours = trainer.compute_logprobs(samples, temperature)
        assert [len(h) for h in http] == [len(r) for _, r in pairs]
        diff = max(float((torch.tensor(h) - o).abs().max()) for h, o in zip(http, ours))
        print(f"HTTP teacher vs Megatron log-probs, T={temperature}: max |diff| = {diff:.2e}")
        assert diff < 1e-4, (temperature, diff)
    # temperature matters (so the check above compares tempered log-probs, not a constant)
    assert max(abs(a - b) for a, b in zip(SGLangTeacher(teacher_url, temperature=0.7).score(pairs)[0],
                                          SGLangTeacher(teacher_url, temperature=1.0).score(pairs)[0])) > 1e-3


def _argv(assets, out, *extra):
    _, student, _, data = assets
    return ["--hf-checkpoint", student, "--prompt-data", data, "--apply-chat-template", "--input-key", "input",
            "--label-key", "label", "--rm-type", "random", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--rollout-max-response-len", "4", "--micro-batch-size", "4", "--lr", "1e-3", "--num-rollout", "2",
            "--resource", '{"actor": [1, 1], "rollout": [1, 1]}', "--num-data-storage-units", "1",
            "--output-dir", str(out), "--distributed-backend", "gloo", *extra]


@pytest.mark.e2e
def test_opd_sglang_end_to_end(assets, teacher_url):
    from conftest import run_steps
    from relax.core.roles import AuxRoles

    out = assets[0] / "run"
    config = parse_config(_argv(assets, out, "--use-opd", "--opd-type", "sglang", "--rm-url", teacher_url,
                                "--opd-kl-coef", "0.5"))
    def uses_http_teacher(controller):
        assert isinstance(controller.aux, AuxRoles) and isinstance(controller.aux.teacher, SGLangTeacher)

    records = run_steps(config, after_start=uses_http_teacher)
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0
        assert math.isfinite(r["train/opd_reverse_kl"]) and abs(r["train/opd_reverse_kl"]) > 1e-4  # teacher != student
        assert r["perf/teacher_logprob_time"] > 0


def test_opd_sglang_flags(assets, tmp_path):
    from relax.config.support import unsupported_flags

    args = _argv(assets, tmp_path / "o", "--use-opd", "--opd-type", "sglang")
    with pytest.raises(ConfigError, match="--rm-url"):
        parse_config(args)
    with pytest.raises(ConfigError, match="remote_rm"):
        parse_config(args + ["--rm-url", "http://h:1", "--rm-type", "remote_rm"])
    with pytest.raises(ConfigError, match="--opd-teacher-load"):
        parse_config(args + ["--rm-url", "http://h:1", "--opd-teacher-load", "/x"])
    config = parse_config(args + ["--rm-url", "http://h:1"])
    assert unsupported_flags(config) == []
