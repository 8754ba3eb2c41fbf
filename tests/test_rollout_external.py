"""--rollout-external --rollout-external-engine-addrs: the controller uses an engine server it did not start.

An embedded engine server is launched here, outside the controller; two GRPO steps run against it.
Generation goes to that engine (no engine of the controller's own exists; the second step's samples
carry the weight version the first sync gave it), the weight sync reaches it (its weight version is 2
and it serves the trainer's weights: its log-probs equal the trainer's), and the controller's shutdown
leaves it running."""

import json

import psutil
import pytest
import ray

from conftest import assert_ray_released, shared_ray, shared_tiny_model

from relax.backends.embedded.launcher import EmbeddedServerProcess
from relax.config import parse_config
from relax.core.controller import Controller

pytestmark = pytest.mark.e2e  # a whole run: Ray, trainer, engines (deselect with -m 'not e2e')


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    base = tmp_path_factory.mktemp("external")
    model = shared_tiny_model()
    data = base / "train.jsonl"
    data.write_text("".join(json.dumps({"input": f"{i}+{i}=", "label": str(2 * i % 10)}) + "\n" for i in range(8)))
    return base, str(model), str(data)


def engine_servers() -> list[int]:
    """Engine servers started by this test process (directly or through Ray's processes)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "relax.backends.embedded.server" in " ".join(p.cmdline()):
                out.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return sorted(out)


def test_two_steps_against_an_external_engine(assets):
    from relax.wire.engine_client import EngineClient
    from relax.rollout.debug_data import load_rollout_data

    base, model, data = assets
    proc = EmbeddedServerProcess(model, server_args={"random_seed": 0, "dtype": "float32",
                                                     "max_running_requests": 64},
                                 log_path=str(base / "external.log"))
    proc.start()
    try:
        proc.wait_healthy(180)
        assert engine_servers() == [proc.pid]
        addr = proc.url[len("http://"):]
        saved = str(base / "saved_{rollout_id}.jsonl")
        config = parse_config([
            "--hf-checkpoint", model, "--prompt-data", data, "--apply-chat-template", "--label-key", "label",
            "--rm-type", "random", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--num-rollout", "2", "--rollout-max-response-len", "4", "--micro-batch-size", "4", "--lr", "1e-3",
            "--lr-decay-style", "constant", "--resource", '{"actor": [1, 1], "rollout": [1, 1]}',
            "--distributed-backend", "gloo", "--rollout-external", "--rollout-external-engine-addrs", addr,
            "--save-debug-rollout-data", saved, "--output-dir", str(base / "run")])
        shared_ray()
        controller = Controller(config)
        try:
            controller.start()
            assert controller.engine_urls == [proc.url]
            assert ray.get(controller.rollout.get_engine_urls.remote()) == [proc.url]
            assert engine_servers() == [proc.pid]  # the controller started no engine of its own
            controller.run()
            client = EngineClient(proc.url, timeout_s=60)
            assert str(client.get_weight_version()) == "2"
            prompt = [257, 84, 82, 68, 81, 198, 18, 10, 19, 28, 258, 198, 257, 64]
            reply = client.generate(prompt, {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True},
                                    return_logprob=True)
            pairs = reply["meta_info"]["output_token_logprobs"]
            ids, engine_lp = [p[1] for p in pairs], [p[0] for p in pairs]
            trainer_lp = ray.get(controller.workers[0].compute_logprobs.remote([prompt + ids], [len(ids)], 1.0))[0]
            assert max(abs(a - b) for a, b in zip(trainer_lp, engine_lp)) < 1e-4, (trainer_lp, engine_lp)
        finally:
            controller.shutdown()
        assert_ray_released()
        # the samples came from this engine: step 1 was generated with the weights of the first sync
        assert {s.weight_version for s in load_rollout_data(saved, 0)} == {0}
        assert {s.weight_version for s in load_rollout_data(saved, 1)} == {1}
        records = [json.loads(x) for x in (base / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [0, 1] and all(r["rollout/num_samples"] == 4.0 for r in records)
        # shutdown left the external engine running and serving
        assert proc.is_alive() and proc.pid in engine_servers()
        after = EngineClient(proc.url, timeout_s=60)
        assert str(after.get_weight_version()) == "2"
        assert after.generate(prompt, {"max_new_tokens": 2}, return_logprob=True)["meta_info"]
    finally:
        proc.stop()
