"""Helpers for tests of engines that speak SGLang's API (reference log-probs from a plain HF model)."""

from __future__ import annotations

from typing import Sequence

import torch


def load_reference_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def reference_logprobs(model, prompt: Sequence[int], output: Sequence[int], temperature: float = 1.0) -> list[float]:
    """log_softmax(logits / T) of each output token given prompt + previous outputs (T=0 -> 1)."""
    if not output:
        return []
    ids = torch.tensor([list(prompt) + list(output)], dtype=torch.long)
    logits = model(input_ids=ids).logits[0].float()
    t = 1.0 if temperature == 0 else float(temperature)
    lp = torch.log_softmax(logits / t, dim=-1)
    start = len(prompt) - 1
    return [lp[start + j, tok].item() for j, tok in enumerate(output)]


@torch.no_grad()
def reference_greedy(model, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by repeated full forward passes (no cache, no stop tokens)."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        ids.append(int(torch.argmax(logits)))
    return ids[len(prompt):]


def response_logprobs(resp: dict) -> list[float]:
    return [float(x[0]) for x in resp["meta_info"]["output_token_logprobs"]]


def max_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def perturbed_state_dict(model, seed: int, scale: float = 0.5) -> list[tuple[str, torch.Tensor]]:
    """New weights (HF names) noticeably different from `model`'s: w + scale * std(w) * noise."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
        std = p.detach().float().std() if p.numel() > 1 else torch.tensor(1.0)
        out.append((name, (p.detach().float() + scale * (std + 1e-3) * noise).to(p.dtype)))
    return out
