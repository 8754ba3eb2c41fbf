"""Training data flags on one rank (real Megatron-core trainer, no Ray): --custom-reward-post-process-path,
--custom-convert-samples-to-train-data-path, --disable-compute-advantages-and-returns, --advantage-estimator
on_policy_distillation (formula), and their parse-time rules.

A custom loss (`capture_loss`) records the padded batch each micro-batch gets, so the tests see exactly what
reached the loss."""

import sys
import types

import pytest
import torch

from megatron_fixtures import toy_rl_samples, trainer_config

from relax import algorithms as alg
from relax.formats.model_arch import ModelArch
from relax.backends.megatron.trainer import MegatronTrainer, TrainerSettings
from relax.config.errors import ConfigError
from relax.config.support import unsupported_flags
from relax.training.advantages import compute_advantages_and_returns, pad_rows, response_mask
from relax.training.step import train_rollout

torch.set_num_threads(1)

pytestmark = pytest.mark.usefixtures("megatron_process")  # tests/megatron_fixtures.py
RANDOM_MODEL = dict(seed=3)  # the model of `model_dir` (tests/conftest.py)

HOOKS = types.ModuleType("relax_test_training_flags_hooks")
HOOKS.seen = []


def _capture_loss(logprobs, entropy, batch, mask):
    HOOKS.seen.append({k: v.detach().clone() for k, v in batch.items()} | {"mask": mask.clone()})
    return -(logprobs * mask).sum() / mask.sum(), {}


def _post_process(args, samples):
    # something checkable: reward * 10 + group index (no group normalisation)
    return [s.reward for s in samples], [s.reward * 10.0 + s.group_index for s in samples]


def _convert(args, samples):
    # keep the first 2 response tokens, mask the second, reward = response token count of the original
    out = {"tokens": [], "response_lengths": [], "loss_masks": [], "rewards": [], "raw_reward": []}
    for s in samples:
        out["tokens"].append(s.prompt_tokens + s.response_tokens[:2])
        out["response_lengths"].append(2)
        out["loss_masks"].append([1, 0])
        out["rewards"].append(float(len(s.response_tokens)))
        out["raw_reward"].append(s.reward + 100.0)
    return out


def _convert_with_advantages(args, samples):
    return {"tokens": [s.tokens for s in samples], "response_lengths": [len(s.response_tokens) for s in samples],
            "advantages": [[0.5 * (i + 1)] * len(s.response_tokens) for i, s in enumerate(samples)]}


HOOKS.capture_loss, HOOKS.post_process, HOOKS.convert = _capture_loss, _post_process, _convert
HOOKS.convert_with_advantages = _convert_with_advantages
sys.modules[HOOKS.__name__] = HOOKS
H = HOOKS.__name__


@pytest.fixture(scope="module")
def trainer(model_dir):
    from transformers import AutoConfig

    t = MegatronTrainer(ModelArch.from_hf_config(AutoConfig.from_pretrained(model_dir)),
                        TrainerSettings(lr=1e-3, micro_batch_size=6, seed=7))
    t.load_hf(model_dir)
    return t


def _samples(n=6, seed=0):
    return toy_rl_samples(n, seed, min_response=3, response_spread=6, reward_step=0.25)


_config = trainer_config


def _run(trainer, *args):
    HOOKS.seen.clear()
    config = _config("--loss-type", "custom_loss", "--custom-loss-function-path", f"{H}.capture_loss", *args)
    assert unsupported_flags(config) == []
    out = train_rollout(trainer, _samples(), config, step=0)
    assert len(HOOKS.seen) == 1  # one micro-batch of all 6 samples
    return out, HOOKS.seen[0]


def test_reward_post_process_replaces_the_group_normalisation(trainer):
    samples = _samples()
    out, batch = _run(trainer, "--custom-reward-post-process-path", f"{H}.post_process")
    expected = torch.tensor([s.reward * 10.0 + s.group_index for s in samples])
    mask = response_mask(samples).float()
    assert torch.allclose(batch["advantages"], expected[:, None] * mask, atol=1e-6)
    assert out["train/raw_reward_mean"] == pytest.approx(sum(s.reward for s in samples) / 6, rel=1e-6)
    assert out["train/reward_mean"] == pytest.approx(float(expected.mean()), rel=1e-6)
    # without the hook the advantages are GRPO's (group-normalised): different
    _, plain = _run(trainer)
    grpo = alg.grpo_advantages(torch.tensor([s.reward for s in samples]), torch.tensor([s.group_index for s in samples]))
    assert torch.allclose(plain["advantages"], grpo[:, None].float() * mask, atol=1e-5)


def test_convert_samples_to_train_data_defines_tokens_masks_and_rewards(trainer):
    samples = _samples()
    out, batch = _run(trainer, "--custom-convert-samples-to-train-data-path", f"{H}.convert")
    # every sample was cut to 2 response tokens with loss mask [1, 0]
    assert batch["advantages"].shape == (6, 2)
    assert torch.equal(batch["mask"], torch.tensor([[1.0, 0.0]] * 6))
    rewards = torch.tensor([float(len(s.response_tokens)) for s in samples])
    assert torch.allclose(batch["advantages"][:, 0], rewards)  # used as given (grpo normalisation not applied)
    assert torch.allclose(batch["rollout_logprobs"], torch.zeros(6, 2))  # response length changed: zeros (unused)
    assert out["train/raw_reward_mean"] == pytest.approx(sum(s.reward + 100.0 for s in samples) / 6, rel=1e-6)
    assert out["train/tokens"] == float(sum(len(s.prompt_tokens) + 2 for s in samples))


def test_convert_errors_name_the_problem(trainer):
    HOOKS.bad = lambda args, samples: {"tokens": [s.tokens for s in samples]}
    with pytest.raises(ValueError, match="response_lengths"):
        train_rollout(trainer, _samples(), _config("--custom-convert-samples-to-train-data-path", f"{H}.bad"), step=0)
    with pytest.raises(ValueError, match="'advantages' are used only with --disable-compute-advantages"):
        train_rollout(trainer, _samples(), _config("--custom-convert-samples-to-train-data-path",
                                                   f"{H}.convert_with_advantages"), step=0)
    HOOKS.short = lambda args, samples: ([1.0], [1.0])
    with pytest.raises(ValueError, match="1 values for 6 samples"):
        train_rollout(trainer, _samples(), _config("--custom-reward-post-process-path", f"{H}.short"), step=0)


def test_disable_compute_advantages_gives_zeros_or_the_converted_advantages(trainer):
    samples = _samples()
    _, batch = _run(trainer, "--disable-compute-advantages-and-returns")
    assert batch["advantages"].abs().sum() == 0  # the rewards are not zero, the advantages are
    assert any(s.reward for s in samples)
    _, batch = _run(trainer, "--disable-compute-advantages-and-returns", "--custom-convert-samples-to-train-data-path",
                    f"{H}.convert_with_advantages")
    mask = response_mask(samples).float()
    assert torch.allclose(batch["advantages"], torch.tensor([0.5 * (i + 1) for i in range(6)])[:, None] * mask)
    # the policy loss trains on the converted advantages (no loss-type needed): a real update
    config = _config("--disable-compute-advantages-and-returns", "--custom-convert-samples-to-train-data-path",
                     f"{H}.convert_with_advantages")
    out = train_rollout(trainer, samples, config, step=0)
    assert out["train/grad_norm"] > 0


def test_on_policy_distillation_is_only_the_opd_term():
    samples = _samples()
    gen = torch.Generator().manual_seed(4)
    student = [-torch.rand(len(s.response_tokens), generator=gen) for s in samples]
    teacher = [-torch.rand(len(s.response_tokens), generator=gen) for s in samples]
    config = _config("--advantage-estimator", "on_policy_distillation", "--use-opd", "--opd-type", "megatron",
                     "--opd-teacher-load", "/x", "--opd-kl-coef", "0.7")
    assert unsupported_flags(config) == []
    adv, _, metrics = compute_advantages_and_returns(samples, config, old_logprobs=student, teacher_logprobs=teacher)
    for a, s, t in zip(adv, student, teacher):
        assert torch.allclose(a, 0.7 * (t - s), atol=1e-6)  # rewards (non-zero here) play no part
    mask = response_mask(samples).float()
    width = mask.shape[1]
    expected_kl = float(((pad_rows(student, width) - pad_rows(teacher, width)) * mask).sum() / mask.sum())
    assert metrics["opd_reverse_kl"] == pytest.approx(expected_kl, rel=1e-5)
    # grpo + OPD keeps the reward advantage: the difference is exactly the group-normalised reward
    grpo = _config("--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "/x", "--opd-kl-coef", "0.7")
    adv_grpo, _, _ = compute_advantages_and_returns(samples, grpo, old_logprobs=student, teacher_logprobs=teacher)
    base = alg.grpo_advantages(torch.tensor([s.reward for s in samples]), torch.tensor([s.group_index for s in samples]))
    for a, g, b in zip(adv, adv_grpo, base):
        assert torch.allclose(g - a, b.float().expand_as(a), atol=1e-5)


@pytest.mark.parametrize("args, words", [
    (["--advantage-estimator", "on_policy_distillation"], ["on_policy_distillation", "--use-opd"]),
    (["--custom-reward-post-process-path", "os.path.join", "--custom-convert-samples-to-train-data-path",
      "os.path.join"], ["--custom-reward-post-process-path"]),
    (["--disable-compute-advantages-and-returns"], ["--disable-compute-advantages-and-returns", "--loss-type"]),
    (["--disable-compute-advantages-and-returns", "--loss-type", "sft", "--kl-coef", "0.1"], ["--kl-coef"]),
    (["--disable-compute-advantages-and-returns", "--loss-type", "sft", "--custom-reward-post-process-path",
      "os.path.join"], ["--custom-reward-post-process-path"]),
    (["--disable-compute-advantages-and-returns", "--advantage-estimator", "ppo",
      "--custom-convert-samples-to-train-data-path", "os.path.join"], ["ppo"]),
    (["--keep-old-actor", "--use-rollout-logprobs"], ["--keep-old-actor", "--use-rollout-logprobs"]),
    (["--true-on-policy-mode", "--use-tis"], ["--true-on-policy-mode", "--use-tis"]),
    (["--true-on-policy-mode", "--update-weights-interval", "2"], ["--keep-old-actor"]),
])
def test_rules_reject_combinations_naming_the_flags(args, words):
    with pytest.raises(ConfigError) as err:
        _config(*args)
    for word in words:
        assert word in str(err.value)


def test_valid_combinations_parse_and_are_supported():
    for args in (["--true-on-policy-mode", "--update-weights-interval", "2", "--keep-old-actor"],
                 ["--disable-compute-advantages-and-returns", "--loss-type", "sft"],
                 ["--use-rollout-entropy", "--recompute-loss-function"]):
        assert unsupported_flags(_config(*args)) == []
