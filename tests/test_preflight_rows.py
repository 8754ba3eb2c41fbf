"""Rows checked against the flags before Ray: each row the rollout would refuse at step 0 stops relax-train
within seconds, exit 2, naming file:line, the flag and the fix (relax/core/preflight.py `row_check`); and the
rollout's own refusals are the same functions (relax/formats/row_checks.py), so both say the same thing."""

from __future__ import annotations

import json
import os
import resource
import time

import pytest

from conftest import relax_cli
from relax.formats.row_checks import (multimodal_problem, prompt_problem, resolve_rm_type, reward_label_problem,
                                   rm_type_problem)

GOOD = {"input": "1+1=", "label": "2"}
MESSAGES = [{"role": "user", "content": "2+2="}]
MM = '{"image": "img"}'
EXTERNAL = ("--rollout-external", "--rollout-external-engine-addrs", "127.0.0.1:1")

# (bad row, extra flags, the flag the message must name, words of the fix)
BAD_ROWS = {
    "message list without the chat template": (
        {"input": MESSAGES, "label": "4"}, ("--rm-type", "exact_match"), "--apply-chat-template",
        "add --apply-chat-template"),
    "a string where a message list is required": (
        {"input": json.dumps(MESSAGES), "label": "4"}, ("--rm-type", "exact_match", "--apply-chat-template"),
        "--apply-chat-template", "store the messages as a JSON array"),
    "a multimodal value the engine cannot take": (
        {"input": "describe", "label": "4", "img": 5}, ("--rm-type", "exact_match", "--multimodal-keys", MM, *EXTERNAL),
        "--multimodal-keys", "path, URL or base64 data URL"),
    "a label the built-in reward cannot read": (
        {"input": "2+2=", "label": {"value": 4}}, ("--rm-type", "math"), "--rm-type math",
        "write the label as a string"),
    "no reward type": (
        {"input": "2+2=", "label": "4"}, (), "--rm-type", "set --rm-type"),
}


@pytest.mark.e2e
@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_a_bad_row_stops_relax_train_before_ray(case, tmp_path, tiny_model):
    row, extra, flag, fix = BAD_ROWS[case]
    data = tmp_path / "rows.jsonl"
    good = dict(GOOD, metadata={"rm_type": "exact_match"}) if case == "no reward type" else GOOD
    data.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    out = tmp_path / "out"
    start, cpu = time.monotonic(), _children_cpu()
    proc = relax_cli("--hf-checkpoint", tiny_model, "--prompt-data", str(data), "--input-key", "input",
                     "--label-key", "label", "--rollout-batch-size", "2", "--num-rollout", "1",
                     "--output-dir", str(out), *extra)
    elapsed, cpu = time.monotonic() - start, _children_cpu() - cpu
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, text[-3000:]
    assert f"rows.jsonl:2: " in errors[0] and f"({flag})" in errors[0] and fix in errors[0], errors[0]
    assert "--prompt-data" in errors[0] and "--skip-bad-lines" not in errors[0]
    assert "Traceback" not in text
    log = (out / "logs" / "relax.log").read_text()
    assert "Ray" not in log and "Ray instance" not in text, log[-2000:]
    # ~1 s of CPU and ~2 s of wall-clock time on an idle 2-core machine. The wall-clock bound holds on a machine
    # that is not oversubscribed; on one that is (other test runs sharing the cores), the CPU time still must.
    assert cpu < 5, f"{case}: {cpu:.1f} s of CPU"
    busy = os.getloadavg()[0] > (os.cpu_count() or 1)
    assert elapsed < (20 if busy else 5), f"{case}: {elapsed:.1f} s (load {os.getloadavg()[0]:.1f})"


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def test_the_rollout_refuses_with_the_same_checks():
    """The run-time refusals are the preflight's functions: the same text, from one definition."""
    from relax.rollout.multimodal import payload_fields
    from relax.rollout.prompts import render_prompt
    from relax.rollout.rewards import builtin

    with pytest.raises(TypeError) as exc:
        render_prompt(MESSAGES, None, apply_chat_template=False)
    assert str(exc.value) == str(prompt_problem(MESSAGES, False))
    with pytest.raises(TypeError) as exc:
        render_prompt(json.dumps(MESSAGES), object(), apply_chat_template=True)
    assert str(exc.value) == str(prompt_problem(json.dumps(MESSAGES), True))
    assert prompt_problem("[1, 2] is a list", True) is None and prompt_problem(MESSAGES, True) is None

    with pytest.raises(ValueError, match="no reward type") as exc:
        resolve_rm_type(None, {})
    assert rm_type_problem(None, {}).fix in str(exc.value)
    assert resolve_rm_type(None, {"rm_type": "f1"}) == "f1" and rm_type_problem("math", None) is None

    label = {"value": 4}
    for rm_type, fn in (("math", builtin.math_reward), ("exact_match", builtin.exact_match_reward),
                        ("dapo", builtin.dapo_reward), ("gpqa", builtin.gpqa_reward), ("f1", builtin.f1_reward)):
        problem = reward_label_problem(rm_type, label)
        with pytest.raises(TypeError) as exc:
            fn("4", label, {})
        assert str(exc.value) == problem.what
    assert reward_label_problem("boxed_math", label) is not None
    assert reward_label_problem("random", label) is None and reward_label_problem("math", ["4", 4]) is None
    assert builtin.random_reward("4", label, {}) in (0.0, 1.0)

    with pytest.raises(ValueError) as exc:
        payload_fields({"image": b"\x89PNG"})
    assert str(exc.value) == str(multimodal_problem("image", b"\x89PNG"))
    assert payload_fields({"image": ["a.png", "data:image/png;base64,AAAA"]}) == {
        "image_data": ["a.png", "data:image/png;base64,AAAA"]}
    assert multimodal_problem("image", []) is not None and multimodal_problem("video", {"url": "v.mp4"}) is None


def test_the_embedded_tasks_repeated_prompts_are_one_info_line_and_a_users_file_still_warns(tmp_path, tiny_model,
                                                                                             caplog):
    import logging
    import shutil

    from relax.config import parse_config
    from relax.core.preflight import preflight
    from relax.models.tasks import generate_task_dataset

    config = parse_config(["--output-dir", str(tmp_path / "run")])  # the embedded default: 10 prompts, batch 32
    shutil.copytree(tiny_model, config.hf_checkpoint)
    generate_task_dataset(config.prompt_data, 100, 0, task="successor")
    with caplog.at_level(logging.INFO, logger="relax"):
        assert preflight(config) == []
    assert [r.levelname for r in caplog.records if "distinct prompts" in r.getMessage()] == ["INFO"]
    own = parse_config(["--hf-checkpoint", config.hf_checkpoint, "--prompt-data", str(shutil.copy(
        config.prompt_data, tmp_path / "mine.jsonl")), "--rollout-batch-size", "32", "--num-rollout", "1",
        "--apply-chat-template", "--rm-type", "exact_match", "--output-dir", str(tmp_path / "own")])
    assert [n for n in preflight(own) if "10 distinct prompt(s), fewer than --rollout-batch-size 32" in n]
