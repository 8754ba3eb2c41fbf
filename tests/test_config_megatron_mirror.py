"""The built-in Megatron flag mirror agrees with Megatron-LM's own parser.

megatron-core 0.16 (what Python 3.11 resolves) ships no megatron.training; the 0.17 wheel does and its
argument module imports on 3.11. scripts/fetch_megatron_lm_args.sh unpacks that wheel (1.7 MB, no
dependencies) into .cache/ so Megatron's real parser can be compared with the mirror in a subprocess.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

DUMP = r"""
import argparse, json, sys, warnings
warnings.simplefilter("ignore")
import megatron.training.arguments as margs
from relax.config.megatron_table import describe_action
p = argparse.ArgumentParser(allow_abbrev=False)
margs.add_megatron_arguments(p)
rows = [describe_action(a) for a in p._actions if a.option_strings and a.dest != "help"]
json.dump(rows, sys.stdout, default=repr)
"""


@pytest.fixture(scope="module")
def megatron_path():
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "fetch_megatron_lm_args.sh")], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHON=sys.executable))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def _env(path):
    return dict(os.environ, PYTHONPATH=os.pathsep.join([path, str(ROOT)]))


def test_mirror_matches_megatron_parser(megatron_path):
    proc = subprocess.run([sys.executable, "-c", DUMP], capture_output=True, text=True, timeout=300,
                          env=_env(megatron_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    real = {row[1]: row for row in json.loads(proc.stdout)}
    from relax.config.megatron_mirror import ROWS

    assert len(ROWS) > 400
    problems = []
    for group, opts, dest, kind, type_name, default, nargs, const, choices in ROWS:
        if dest not in real:
            problems.append(f"{opts[0]}: not in Megatron's parser")
            continue
        r_opts, _, r_kind, r_type, r_default, r_nargs, r_const, r_choices = real[dest]
        mine = (list(opts), kind, type_name, json.loads(json.dumps(default, default=repr)), nargs, choices)
        theirs = (r_opts, r_kind, r_type, r_default, r_nargs, r_choices)
        if mine != theirs:
            problems.append(f"{opts[0]}: mirror {mine} != megatron {theirs}")
    assert not problems, "\n".join(problems[:20])


DUMP_GROUPS = r"""
import argparse, json, sys, warnings
warnings.simplefilter("ignore")
import megatron.training.arguments as margs
p = argparse.ArgumentParser(allow_abbrev=False)
margs.add_megatron_arguments(p)
json.dump([[g.title, list(a.option_strings)] for g in p._action_groups for a in g._group_actions
           if a.option_strings and a.dest != "help"], sys.stdout)
"""


def test_mirror_is_exactly_what_the_installed_megatron_knows(megatron_path):
    """One Megatron version: setup.py pins the megatron-core that is installed, and a Megatron flag is
    accepted exactly when that megatron-core has the setting behind it.

    The table holds every flag of the mirrored groups of the parser it was generated from, no more and no
    less; of those, the mirror leaves out exactly the flags whose config field (a dataclass field of
    megatron.core in the parser's release) the installed megatron.core lacks.
    """
    import importlib.metadata
    import importlib.util
    from pathlib import Path

    from relax.config.megatron_mirror import MEGATRON_VERSION, ROWS
    from relax.config.megatron_table import (ABSENT_FROM_INSTALLED, INSTALLED_MEGATRON_CORE, MIRRORED_EXTRA_FLAGS,
                                             MIRRORED_GROUPS, dataclass_fields)
    from relax.config.parser import build_parser

    assert importlib.metadata.version("megatron-core") == INSTALLED_MEGATRON_CORE
    assert f'"megatron-core=={INSTALLED_MEGATRON_CORE}"' in (ROOT / "setup.py").read_text()
    assert megatron_path.endswith(MEGATRON_VERSION)  # the parser the table was generated from

    proc = subprocess.run([sys.executable, "-c", DUMP_GROUPS], capture_output=True, text=True, timeout=300,
                          env=_env(megatron_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    wanted = {tuple(opts) for title, opts in json.loads(proc.stdout)
              if title in MIRRORED_GROUPS or any(o in MIRRORED_EXTRA_FLAGS for o in opts)}
    assert {tuple(row[1]) for row in ROWS} == wanted

    installed_core = importlib.util.find_spec("megatron.core").submodule_search_locations[0]
    installed, parsers = dataclass_fields(installed_core), dataclass_fields(Path(megatron_path) / "megatron" / "core")
    absent = {row[1][0] for row in ROWS if row[2] in parsers and row[2] not in installed}
    assert absent == set(ABSENT_FROM_INSTALLED)

    parser, _ = build_parser(use_megatron_parser=False)
    options = set(parser._option_string_actions)
    assert not options & ABSENT_FROM_INSTALLED
    assert all(row[1][0] in options for row in ROWS if row[1][0] not in ABSENT_FROM_INSTALLED)


def test_lazy_mpu_init_takes_both_forms():
    from relax.config import parse_config

    for argv, value in ([], False), (["--lazy-mpu-init"], True), (["--lazy-mpu-init", "True"], True):
        assert parse_config(argv + ["--output-dir", "/tmp/relax-mirror"], use_megatron_parser=False).lazy_mpu_init \
            is value


def test_mirror_parser_behaves_like_megatron(megatron_path):
    """Parsing a Qwen3-MoE flag set through both parsers gives the same values."""
    argv = ["--num-layers", "48", "--hidden-size", "2048", "--moe-layer-freq", "([1]*47+[0])",
            "--num-experts", "128", "--moe-router-topk", "8", "--disable-bias-linear", "--swiglu",
            "--normalization", "RMSNorm", "--attention-backend", "flash", "--window-size", "(128,0)",
            "--moe-aux-loss-coeff", "0.001", "--optimizer-cpu-offload", "--lr-decay-style", "cosine"]
    script = (
        "import argparse, json, sys, warnings\nwarnings.simplefilter('ignore')\n"
        "import megatron.training.arguments as m\n"
        "p = argparse.ArgumentParser(allow_abbrev=False); m.add_megatron_arguments(p)\n"
        f"a = vars(p.parse_args({argv!r}))\n"
        "keys = ['num_layers','hidden_size','moe_layer_freq','num_experts','moe_router_topk','add_bias_linear',"
        "'swiglu','normalization','window_size','moe_aux_loss_coeff','optimizer_cpu_offload','lr_decay_style']\n"
        "out = {k: a[k] for k in keys}; out['attention_backend'] = a['attention_backend'].name\n"
        "json.dump(out, sys.stdout, default=list)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=_env(megatron_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    theirs = json.loads(proc.stdout)
    from relax.config import parse_config

    # a model folder of its own: without one the embedded default's tiny model would disagree with these flags
    cfg = parse_config(argv + ["--hf-checkpoint", "/nonexistent-model", "--output-dir", "/tmp/relax-mirror"],
                       use_megatron_parser=False)
    mine = {k: (list(cfg[k]) if isinstance(cfg[k], tuple) else cfg[k]) for k in theirs}
    assert mine == theirs


def test_real_megatron_parser_is_merged(megatron_path):
    """With megatron.training importable, any Megatron flag is accepted (not only mirrored ones)."""
    script = (
        "from relax.config import parse_config\n"
        "cfg = parse_config(['--data-path', 'a', 'b', '--rl-skip-bos-token', "
        "'--lr', '2e-6', '--output-dir', '/tmp/relax-mlm'])\n"
        "from relax.config.parser import build_parser\n"
        "owner = build_parser()[0]._option_string_actions['--eval-interval'].help\n"
        "print(cfg.meta['sources']['megatron'], cfg.data_path, 'rollout' in owner, cfg.lr, cfg.seed)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=_env(megatron_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["megatron-lm", "['a',", "'b']", "True", "2e-06", "1234"]
