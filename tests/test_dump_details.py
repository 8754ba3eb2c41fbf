"""--dump-details / --save-debug-train-data through the controller (Ray, 2 data-parallel Megatron ranks on
CPU, an embedded engine): every step's rollout samples and every rank's training inputs land in the dump
directory; the training inputs are exactly the generated tokens with the GRPO advantages of the saved
rewards; the files load without unpickling (weights_only=True)."""

import json
import numpy as np
import pytest
import torch

from conftest import shared_tiny_model

from relax.config import parse_config
from relax.core.run import run_controller
from relax.observability.train_dump import load_train_data, save_train_data, train_data_path


def test_train_data_path_and_rank_rule(tmp_path):
    assert train_data_path("d/{rollout_id}_{rank}.pt", 3, 1) == "d/3_1.pt"
    assert train_data_path("d/{rollout_id}.pt", 3, 0) == "d/3.pt"
    assert train_data_path("d/{rollout_id}.pt", 3, 1) is None  # no {rank}: only rank 0 writes
    x = [{"tokens": torch.tensor([1, 2, 3]), "response_length": 2, "loss_mask": torch.ones(2),
          "advantages": torch.tensor([0.5, 0.5])}]
    path = save_train_data(str(tmp_path / "t_{rollout_id}.pt"), 7, 0, x, [11])
    data = load_train_data(path)
    assert data["rollout_id"] == 7 and data["samples"][0]["index"] == 11
    assert data["samples"][0]["tokens"].tolist() == [1, 2, 3]
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(Exception):
        load_train_data(str(tmp_path / "bad.pt"))


def test_dump_details_writes_rollout_and_train_data_of_every_step(tmp_path):
    model = shared_tiny_model()
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"input": f"{i}", "label": str(i % 3)}) + "\n" for i in range(8)))
    dump = tmp_path / "dump"
    config = parse_config([
        "--hf-checkpoint", str(model), "--prompt-data", str(data), "--label-key", "label",
        "--rm-type", "exact_match", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
        "--num-rollout", "2", "--rollout-max-response-len", "1", "--micro-batch-size", "2", "--lr", "1e-3",
        "--lr-decay-style", "constant", "--resource", '{"actor": [1, 2], "rollout": [1, 1]}',
        "--distributed-backend", "gloo", "--output-dir", str(tmp_path / "out"), "--dump-details", str(dump)])
    assert config.save_debug_rollout_data == str(dump / "rollout_data" / "{rollout_id}.jsonl")
    assert run_controller(config) == 0
    assert (dump / "config.yaml").is_file()

    for step in range(2):
        rows = [json.loads(x) for x in (dump / "rollout_data" / f"{step}.jsonl").read_text().splitlines()[1:]]
        assert len(rows) == 8
        for rank in range(2):
            saved = load_train_data(str(dump / "train_data" / f"{step}_{rank}.pt"))
            assert saved["rollout_id"] == step and saved["rank"] == rank
            by_index = {r["index"]: r for r in rows}
            assert sorted(x["index"] for x in saved["samples"]) == sorted(by_index)
            for x in saved["samples"]:
                sample = by_index[x["index"]]
                # trained on exactly the generated tokens
                assert x["tokens"].tolist() == sample["prompt_tokens"] + sample["response_tokens"]
                assert x["response_length"] == len(sample["response_tokens"])
            # GRPO advantages of the saved rewards (unbiased std per prompt group), on every response token
            groups = {}
            for r in rows:
                groups.setdefault(r["group_index"], []).append(r)
            for members in groups.values():
                rewards = np.array([m["reward"] for m in members], dtype=np.float64)
                expected = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)
                for m, adv in zip(members, expected):
                    got = next(x for x in saved["samples"] if x["index"] == m["index"])["advantages"]
                    assert torch.allclose(got, torch.full_like(got, float(adv)), atol=1e-5)
