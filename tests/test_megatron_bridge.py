"""--megatron-to-hf-mode: the raw converter behind the shared interface, and the bridge mode (Megatron-Bridge's
AutoBridge) refused at parse time where the package cannot be imported (the CPU stack); where it imports,
bridge and raw must give identical weights."""

import pytest
import torch

from conftest import shared_tiny_model

from relax.backends.megatron import bridge as B
from relax.config.errors import ConfigError

torch.set_num_threads(1)


def _argv(tmp_path, *extra):

    return ["--hf-checkpoint", str(shared_tiny_model()), *extra]


@pytest.mark.skipif(B.bridge_unavailable_reason() is None, reason="Megatron-Bridge imports here")
def test_bridge_mode_is_refused_before_a_run_naming_the_flag_and_the_package(tmp_path):
    from relax.config.explain import explain
    from relax.config.parser import parse_config
    from relax.config.support import require_supported, unsupported_flags

    argv = _argv(tmp_path)
    assert parse_config(argv).megatron_to_hf_mode == "raw"
    assert unsupported_flags(parse_config(argv + ["--megatron-to-hf-mode", "raw"])) == []
    # no Megatron-Bridge release installs beside transformers 5: a real run stops before Ray naming the conflict
    # (releases, pins) and the fix; --dry-run lists it with the same reason
    bridge = parse_config(argv + ["--megatron-to-hf-mode", "bridge"])
    (refused,) = unsupported_flags(bridge)
    assert refused.startswith("--megatron-to-hf-mode bridge (a dependency conflict: Megatron-Bridge (PyPI "
                              "megatron-bridge 0.3.0 and 0.3.1, every release) requires transformers<5.0.0")
    with pytest.raises(ConfigError) as exc:
        require_supported(bridge)
    msg = str(exc.value)
    assert msg.startswith("refused: --megatron-to-hf-mode bridge") and "not supported yet" not in msg
    assert "transformer-engine[core_cu13,pytorch]<2.13" in msg and "use --megatron-to-hf-mode raw" in msg
    assert "--megatron-to-hf-mode bridge (a dependency conflict" in explain(bridge)
    if B.bridge_unavailable_reason():
        with pytest.raises(ConfigError, match=r"--megatron-to-hf-mode bridge.*megatron.bridge.*transformers<5.0.0"):
            B.check_bridge_mode(bridge.to_dict())
    with pytest.raises(RuntimeError, match="pip install megatron-bridge cannot keep Relax's pins"):
        B.make_converter("bridge", None, str(tmp_path / "m"))
    with pytest.raises(ValueError, match="unknown --megatron-to-hf-mode"):
        B.make_converter("auto")


def _tiny_megatron(tmp_path, family="qwen2"):
    from transformers import AutoConfig

    from relax.backends.megatron.transformer_config import to_transformer_config
    from relax.formats.model_arch import ModelArch
    from relax.backends.megatron.model import build_gpt_model
    from relax.backends.megatron.testing import build_random_tiny_model, ensure_single_process

    ensure_single_process()
    path = build_random_tiny_model(tmp_path / family, family, seed=5)
    arch = ModelArch.from_hf_config(AutoConfig.from_pretrained(path))
    return path, arch, build_gpt_model(arch, to_transformer_config(arch)).eval()


def test_raw_converter_loads_and_exports_an_hf_folder_exactly(tmp_path):
    from relax.backends.megatron.hf_weights import load_hf_checkpoint_dir

    path, arch, model = _tiny_megatron(tmp_path)
    conv = B.make_converter("raw", arch, str(path))
    conv.load([model])
    state = load_hf_checkpoint_dir(path)
    exported = dict(conv.export(model))
    assert set(exported) == set(state.keys())
    for name, t in exported.items():
        assert torch.equal(t, state[name]), name
    half = dict(conv.export(model, dtype=torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, state[n].to(torch.bfloat16)) for n, t in half.items())


@pytest.mark.skipif(B.bridge_unavailable_reason() is not None, reason="Megatron-Bridge does not import here "
                    "(needs Transformer Engine and transformers<5)")
def test_bridge_and_raw_give_identical_weights(tmp_path):  # pragma: no cover - needs a CUDA stack
    path, arch, model = _tiny_megatron(tmp_path)
    raw, bridge = B.make_converter("raw", arch, str(path)), B.make_converter("bridge", arch, str(path))
    bridge.load([model])
    via_bridge = {n: t.clone() for n, t in bridge.export([model])}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    raw.load([model])
    via_raw = dict(raw.export([model]))
    assert set(via_bridge) == set(via_raw)
    for name in via_raw:
        assert torch.equal(via_bridge[name], via_raw[name]), name
