"""Helpers for tests of the Megatron backend: tiny models, toy data, multi-process runs."""

from __future__ import annotations

import io
import os
import socket
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

__all__ = [
    "build_random_tiny_model",
    "build_random_tiny_moe_model",
    "toy_samples",
    "toy_pg_loss",
    "hf_response_logprobs",
    "run_ranks",
    "ensure_single_process",
    "hf_arch",
    "hf_trainer",
]


def build_random_tiny_model(path: str | Path, family: str = "qwen2", seed: int = 0, **arch_kwargs) -> Path:
    """A tiny HF model whose every tensor (norms and biases included) is random."""
    from safetensors.torch import load_file, save_file

    from relax.models.tiny import TinyArch, build_tiny_model_dir

    path = build_tiny_model_dir(path, TinyArch(family=family, **arch_kwargs), seed=seed)
    weights = path / "model.safetensors"
    state = load_file(str(weights))
    gen = torch.Generator().manual_seed(seed + 1)
    for name, tensor in state.items():
        noise = torch.randn(tensor.shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            state[name] = (1.0 + 0.2 * noise).to(tensor.dtype)
        elif name.endswith(".bias"):
            state[name] = (0.1 * noise).to(tensor.dtype)
        else:
            state[name] = (0.1 * noise).to(tensor.dtype)
    save_file(state, str(weights), metadata={"format": "pt"})
    return path


def build_random_tiny_moe_model(path: str | Path, seed: int = 0, num_experts: int = 4) -> Path:
    """A tiny random Qwen3-MoE HF model (no tokenizer), every tensor random."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=num_experts, num_experts_per_tok=2, norm_topk_prob=True,
        max_position_embeddings=256, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.1 * noise)
    path = Path(path)
    model.save_pretrained(path)
    return path


def toy_samples(
    count: int, seed: int = 0, vocab: int = 256, min_len: int = 6, max_len: int = 24
) -> list[dict]:
    """Random prompt+response samples with advantages, old log-probs and a loss mask."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(count):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        resp = int(torch.randint(1, length - 1, (1,), generator=gen))
        loss_mask = torch.ones(resp)
        if resp > 2:
            loss_mask[-1] = 0.0
        samples.append(
            {
                "tokens": torch.randint(0, vocab, (length,), generator=gen),
                "response_length": resp,
                "advantages": torch.randn(resp, generator=gen),
                "old_logprobs": -torch.rand(resp, generator=gen) * 5,
                "loss_mask": loss_mask,
            }
        )
    return samples


def toy_pg_loss(logprobs, entropy, batch, mask):
    """A clipped-ratio policy-gradient loss (PPO-style), mean over masked tokens."""
    ratio = torch.exp(logprobs - batch["old_logprobs"])
    adv = batch["advantages"]
    per_token = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    denom = mask.sum().clamp(min=1.0)
    loss = (per_token * mask).sum() / denom
    metrics = {"ratio_mean": ((ratio * mask).sum() / denom).detach()}
    if entropy is not None:
        metrics["entropy"] = ((entropy * mask).sum() / denom).detach()
    return loss, metrics


@torch.no_grad()
def hf_response_logprobs(hf_model, samples: list[dict], temperature: float = 1.0) -> list[torch.Tensor]:
    """Reference log-probs of each sample's response tokens from a transformers model."""
    out = []
    for sample in samples:
        tokens = sample["tokens"]
        resp = sample["response_length"]
        n = tokens.numel()
        logits = hf_model(tokens.unsqueeze(0)).logits[0].float() / temperature
        logp = torch.log_softmax(logits, dim=-1)[n - resp - 1 : n - 1]
        out.append(logp.gather(1, tokens[n - resp :].unsqueeze(1)).squeeze(1))
    return out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_entry(rank: int, world: int, port: int, fn: Callable, args: tuple, queue) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        from relax.backends.megatron.parallel import destroy, init_distributed

        init_distributed(rank, world, "127.0.0.1", port, backend="gloo", timeout_minutes=2)
        result = fn(rank, world, *args)
        buffer = io.BytesIO()
        torch.save(result, buffer)  # plain bytes: no shared-memory handles outlive the rank
        queue.put((rank, "ok", buffer.getvalue()))
        destroy()
    except BaseException:  # report any failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
        raise


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 240.0) -> list[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` spawned gloo processes.

    Returns the per-rank results (must be picklable); raises with the remote
    traceback if any rank fails.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_entry, args=(r, world_size, port, fn, args, queue), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    return [results[r] for r in range(world_size)]


def ensure_single_process() -> None:
    """Join a one-rank gloo group with TP=PP=1 in this process (idempotent)."""
    import torch.distributed as dist

    from relax.backends.megatron.parallel import init_distributed, init_model_parallel

    if not dist.is_initialized():
        init_distributed(0, 1, "127.0.0.1", _free_port(), backend="gloo")
    init_model_parallel(1, 1)


def hf_arch(path: str | Path):
    """The `ModelArch` of an HF model folder."""
    from transformers import AutoConfig

    from relax.formats.model_arch import ModelArch

    return ModelArch.from_hf_config(AutoConfig.from_pretrained(str(path)))


def hf_trainer(path: str | Path, **settings: Any):
    """A `MegatronTrainer` with `TrainerSettings(**settings)` for the HF model folder `path`, its weights loaded."""
    from relax.backends.megatron.trainer import MegatronTrainer, TrainerSettings

    trainer = MegatronTrainer(hf_arch(path), TrainerSettings(**settings))
    trainer.load_hf(path)
    return trainer
