"""Layers only import downward: a walk of relax/'s import graph (docs/architecture.md, "Layers").

Each package of relax/ has a layer; a module may import its own package and any package of a lower layer.
An import of a higher layer is an error naming the file, the line and the two layers, unless it is listed in
`KNOWN_UPWARD` (empty: every arrow points down; an entry that no longer occurs fails too and must be removed).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "relax"

# package (or top-level module) of relax/ -> its layer; lower layers never import higher ones
LAYERS = {
    "importing": 0, "heap": 0, "lazy_jit": 0, "transformers_index": 0,  # import-time utilities of the package root
    "formats": 0,  # model architectures, checkpoint folders, prompt files: pure rules over files
    "models": 0,  # the embedded default's model and task, built from nothing but transformers
    "health_faults": 0,  # test-only fault injection, armed by the environment, read by every role that can fail
    "config": 1,  # flags, validation, derived facts: pure rules over values
    "algorithms": 2, "data": 2, "observability": 2,
    "wire": 2,  # the engines' HTTP API client, the run's key, ports, SGLang's tensor payload
    "weights": 3,  # the weight-sync wire formats and paths, shared by the trainer and the engines
    "backends": 4, "training": 4,
    "rollout": 5,
    "roles": 6,  # the Ray actors around backends, training and rollout
    "core": 7,  # the controller, the loops, checkpoints, health
    "entrypoints": 8,
}

# (importing file, imported module): upward imports not yet turned around
KNOWN_UPWARD: set[tuple[str, str]] = set()


def _layer_of(path: Path, root: Path) -> str:
    return path.relative_to(root).with_suffix("").parts[0]


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every `relax.*` import in `path`, at any depth (a lazy import inside a function too)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("relax.")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "relax":  # `from relax import heap`
                out += [(node.lineno, f"relax.{a.name}") for a in node.names]
            elif node.module.startswith("relax."):
                out.append((node.lineno, node.module))
    return out


def upward_imports(root: Path = ROOT) -> list[tuple[str, int, str, str]]:
    """(file relative to relax/, line, imported module, why) of every import of a higher layer."""
    found = []
    for path in sorted(root.rglob("*.py")):
        root_init = path.parent == root and path.name == "__init__.py"  # the package root: layer 0
        importer = "__init__" if root_init else _layer_of(path, root)
        own = 0 if root_init else LAYERS.get(importer, -1)
        for line, module in _imports(path):
            target = module.split(".")[1]
            if target == importer or target not in LAYERS:
                continue
            if LAYERS[target] > own:
                found.append((str(path.relative_to(root)), line, module,
                              f"{importer} (layer {own}) imports {target} (layer {LAYERS[target]})"))
    return found


def test_every_package_has_a_layer():
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in ROOT.glob("*.py") if p.name != "__init__.py"}
    assert packages | modules <= set(LAYERS), sorted((packages | modules) - set(LAYERS))


def test_layers_only_import_downward():
    found = upward_imports()
    new = [f"relax/{f}:{line}: {module} ({why})" for f, line, module, why in found if (f, module) not in KNOWN_UPWARD]
    assert not new, "imports of a higher layer (turn the dependency around or move the shared part down):\n" + \
        "\n".join(new)
    gone = KNOWN_UPWARD - {(f, module) for f, _, module, _ in found}
    assert not gone, f"no longer imported upward: remove from KNOWN_UPWARD: {sorted(gone)}"


def test_the_package_root_imports_only_its_utilities():
    """`import relax` (every process's first import) loads no backend, Ray, torch or config."""
    imported = {module.split(".")[1] for _, module in _imports(ROOT / "__init__.py")}
    assert imported <= {name for name, layer in LAYERS.items() if layer == 0}, imported


def test_an_upward_import_is_found(tmp_path):
    pkg = tmp_path / "relax"
    (pkg / "config").mkdir(parents=True)
    (pkg / "core").mkdir()
    (pkg / "config" / "rules.py").write_text("def f():\n    from relax.core.controller import Controller\n")
    (pkg / "core" / "loop.py").write_text("from relax.config.config import Config\n")
    found = upward_imports(pkg)
    assert [(f, line, m) for f, line, m, _ in found] == [("config/rules.py", 2, "relax.core.controller")]


@pytest.mark.parametrize("layer", sorted(set(LAYERS.values())))
def test_layers_are_documented(layer):
    text = (ROOT.parent / "docs" / "architecture.md").read_text()
    for name, value in LAYERS.items():
        if value == layer:
            assert f"`{name}`" in text, f"docs/architecture.md's layer table does not name {name}"
