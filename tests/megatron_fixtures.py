"""The Megatron tests' fixtures and helpers (tests that run Megatron-core's trainer in this process, one rank over
gloo). Registered for every test by tests/conftest.py (`pytest_plugins`); a module that builds Megatron models
in this process asks for the process state with

    pytestmark = pytest.mark.usefixtures("megatron_process")

and for a random model of its own with `RANDOM_MODEL = dict(seed=...)` (the `model_dir` fixture of
tests/conftest.py)."""

import pytest


@pytest.fixture(scope="module")
def megatron_process():
    """Megatron-core's parallel state for one rank in this process, set up before the module's first test."""
    from relax.backends.megatron.testing import ensure_single_process

    ensure_single_process()


def toy_rl_samples(n=6, seed=0, min_response=2, response_spread=7, tool_token=False, reward_step=0.0):
    """`n` rollout Samples of random tokens and log-probs (groups of 3, reward i % 2 + reward_step * i): prompts of
    3-6 tokens,
    responses of `min_response + (i * 5) % response_spread` tokens, all of them trained on, except with
    `tool_token` the second token of a response longer than 3 (as a tool's output inside the response)."""
    import torch

    from relax.data.sample import Sample

    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        plen, rlen = 3 + i % 4, min_response + (i * 5) % response_spread
        mask = [1] * rlen
        if tool_token and rlen > 3:
            mask[1] = 0
        out.append(Sample(index=i, group_index=i // 3,
                          prompt_tokens=torch.randint(0, 250, (plen,), generator=gen).tolist(),
                          response_tokens=torch.randint(0, 250, (rlen,), generator=gen).tolist(),
                          response_logprobs=(-torch.rand(rlen, generator=gen) * 3).tolist(), loss_mask=mask,
                          reward=float(i % 2) + reward_step * i))
    return out


def trainer_config(*args, lr="1e-3"):
    """A run's Config for the trainer-side tests: 2 prompts x 3 samples a step, one global batch of 6."""
    from relax.config import parse_config

    # a model path keeps the embedded-default preset (no model and no data given) out of these configs
    return parse_config(["--hf-checkpoint", "unused-model-dir", "--rollout-batch-size", "2", "--n-samples-per-prompt",
                         "3", "--global-batch-size", "6", "--lr", lr, *args])
