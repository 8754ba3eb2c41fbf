"""Checks shared by the model-family tests (GLM4, Nemotron, Qwen2-MoE): each family's Megatron model, once
its weights are pushed to the embedded engine, is what the engine serves."""

import torch

from relax.backends.embedded.engine import EmbeddedEngine
from relax.backends.embedded.sampling import SamplingParams
from relax.backends.megatron.hf_weights import export_hf_weights


def check_engine_serves_pushed_weights(model, arch, path, hf, engine_class: str) -> None:
    """A weight push: `model` (Megatron, built from the HF folder `path`) after an update (here: noise), exported
    and copied into the embedded engine's HF model of class `engine_class`; the engine's greedy tokens and their
    log-probs are then Megatron's, and differ from those of `hf` (the weights before the push)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
    engine = EmbeddedEngine(str(path), random_seed=0).start()
    try:
        assert type(engine.model).__name__ == engine_class
        engine.update_weights(list(export_hf_weights(model, arch)), weight_version="1").result(60)
        prompt = [5, 17, 42, 99, 3, 250]
        params = SamplingParams.from_dict({"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True})
        reply = engine.submit(engine.make_request(prompt, params, return_logprob=True)).result(60)
    finally:
        engine.shutdown()
    served = reply["meta_info"]["output_token_logprobs"]
    tokens = [token for _, token, _ in served]
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        ours = torch.log_softmax(model(ids, torch.arange(ids.shape[1]).unsqueeze(0), None)[0], dim=-1)
        before = torch.log_softmax(hf(ids).logits[0], dim=-1)
    rows = range(len(prompt) - 1, ids.shape[1] - 1)
    assert tokens == [int(ours[r].argmax()) for r in rows]  # greedy under the pushed weights
    expected = torch.tensor([float(ours[r, t]) for r, t in zip(rows, tokens)])
    torch.testing.assert_close(torch.tensor([lp for lp, _, _ in served]), expected, rtol=1e-4, atol=1e-4)
    assert max(abs(float(before[r, t]) - float(ours[r, t])) for r, t in zip(rows, tokens)) > 1e-3
