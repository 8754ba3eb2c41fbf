"""LoRA under tensor parallelism (with and without sequence parallelism) and with the distributed optimizer over
two data-parallel ranks, on CPU over gloo, against one rank: log-probs, loss and the adapters after the steps
(relax/backends/megatron/lora.py: A of a column-parallel linear replicated and B split like its weight's rows, A of
a row-parallel linear split like its weight's columns and B replicated). Two spawned processes run every layout
in turn; the one-rank reference runs in the test process. The PEFT export (--save-hf) gathered over TP equals TP
1's, and a PEFT adapter written under TP 2 loads back (--lora-load) into a TP 2 trainer exactly."""

from pathlib import Path

import pytest
import torch

from relax.backends.megatron.lora import LoraSettings, adapter_tensors
from relax.backends.megatron.testing import (
    build_random_tiny_model,
    ensure_single_process,
    hf_trainer,
    run_ranks,
    toy_pg_loss,
    toy_samples,
)

torch.set_num_threads(1)

STEPS = 2
TEMPERATURE = 0.8
BASE = dict(lr=1e-2, micro_batch_size=2, seed=11, clip_grad=1.0, lora=LoraSettings(rank=4, alpha=8.0, seed=11))
LAYOUTS = {
    "tp2": dict(tp=2),
    "tp2_sp": dict(tp=2, sequence_parallel=True),
    "dp2_distopt": dict(use_distributed_optimizer=True),
}


def _run(trainer, samples):
    from relax.backends.megatron.lora_peft import peft_tensors

    out = {"logprobs": trainer.compute_logprobs(samples, TEMPERATURE),
           "metrics": [trainer.train_step(samples, toy_pg_loss, TEMPERATURE) for _ in range(STEPS)]}
    out["adapters"] = adapter_tensors(trainer.gpt_model)
    out["weights"] = dict(trainer.export_hf_weights())  # merged
    out["peft"] = dict(peft_tensors(trainer.gpt_model, trainer.arch))
    return out


def _peft_round_trip(trainer, path, samples, folder):
    """--save-hf's PEFT adapter written under TP 2, read back by --lora-load into a fresh TP 2 trainer."""
    import torch.distributed as dist

    from relax.backends.megatron.checkpoint import finish_hf_folder, snapshot_rank, write_rank
    from relax.backends.megatron.lora import load_adapters

    snap = snapshot_rank(trainer, save_optim=False, hf=True)
    write_rank(snap, f"{folder}/ckpt", f"{folder}/hf")
    if snap.hf_part():
        finish_hf_folder(Path(folder) / "hf", [snap.hf_part()], str(path))
    dist.barrier()
    fresh = hf_trainer(path, **BASE, **LAYOUTS["tp2"])
    load_adapters(fresh, f"{folder}/hf")
    return all(torch.equal(a, b) for a, b in zip(fresh.compute_logprobs(samples, TEMPERATURE),
                                                 trainer.compute_logprobs(samples, TEMPERATURE)))


def _worker(rank, world, path, samples, folder):
    from megatron.core import parallel_state as ps

    results = {}
    for layout in LAYOUTS:
        trainer = hf_trainer(path, **BASE, **LAYOUTS[layout])
        mine = samples
        if trainer.layout.dp > 1:  # each data-parallel rank gets its own half
            per = len(samples) // trainer.layout.dp
            mine = samples[trainer.layout.dp_rank * per:(trainer.layout.dp_rank + 1) * per]
        results[layout] = _run(trainer, mine)
        if layout == "tp2":
            results["peft_round_trip"] = _peft_round_trip(trainer, path, samples, folder)
        ps.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = build_random_tiny_model(tmp_path_factory.mktemp("lora_par") / "qwen2", "qwen2", seed=21)
    samples = toy_samples(4, seed=9)
    folder = tmp_path_factory.mktemp("lora_par_peft")
    ranks = run_ranks(_worker, 2, str(path), samples, str(folder), timeout=400)
    ensure_single_process()
    return {"ranks": ranks, "reference": _run(hf_trainer(path, **BASE), samples), "samples": samples}


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_layout_matches_one_rank(setup, layout):
    ref = setup["reference"]
    for rank, result in enumerate(setup["ranks"]):
        out = result[layout]
        if layout != "dp2_distopt":  # the TP peers compute the whole batch's log-probs
            assert _max_diff(out["logprobs"], ref["logprobs"]) < 1e-5
        for got, want in zip(out["metrics"], ref["metrics"]):
            for key in ("loss", "grad_norm", "ratio_mean"):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (layout, key)
        assert set(out["adapters"]) == set(ref["adapters"])
        for name, tensor in out["adapters"].items():
            # Adam's first steps move each element by about lr: reduction-order noise in a near-zero gradient
            # element moves it by a small fraction of lr (as in tests/test_megatron_parallel.py)
            assert (tensor - ref["adapters"][name]).abs().max().item() < 0.1 * BASE["lr"], (layout, name)
        assert set(out["weights"]) == set(ref["weights"])
        worst = max((out["weights"][k] - ref["weights"][k]).abs().max().item() for k in ref["weights"])
        assert worst < 0.1 * BASE["lr"], (layout, worst)
        assert set(out["peft"]) == set(ref["peft"])  # the PEFT export, gathered over TP
        assert max((out["peft"][k] - ref["peft"][k]).abs().max().item() for k in ref["peft"]) < 0.1 * BASE["lr"]
    # both ranks hold the same full adapters and merged weights
    a, b = (r[layout] for r in setup["ranks"])
    assert all(torch.equal(a["adapters"][k], b["adapters"][k]) for k in a["adapters"])
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])


def test_peft_export_round_trips_under_tp2(setup):
    assert all(r["peft_round_trip"] for r in setup["ranks"])


def test_adapters_moved(setup):
    """The comparison above is not of untouched adapters: B left zero and, at the second step, A moved."""
    ref = setup["reference"]["adapters"]
    assert any(k.endswith("lora_B") and t.abs().max() > 0 for k, t in ref.items())
