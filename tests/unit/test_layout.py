"""The layout is checked by tools, not by review.

- every package folder is installed under ``shardps`` (pyproject's ``packages``
  and ``package-dir``), nothing as a bare ``server`` or ``worker``;
- import-linter's contracts in ``pyproject.toml`` hold (layers: commands and
  apps over server | worker over common over proto; the node room over the
  worker library; the shard's rooms under its store and service);
- no module reaches into another object's private names (``x._name`` with
  ``x`` other than ``self``/``cls``), besides torch's own internals listed below;
- rooms stay small: at most 15 modules a room, no module over 550 lines.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PACKAGE_DIRS: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]

#: Private names of torch (and the GradScaler) that shardps reads on purpose, each with its reason.
TORCH_PRIVATE = {
    "_foreach_mul_": "the fused multi-tensor ops of the shard's clip and unscale",
    "_foreach_norm": "the fused multi-tensor norm of the shard's clip",
    "_amp_foreach_non_finite_check_and_unscale_": "GradScaler's own fused unscale, on the shard",
    "_version": "a tensor's in-place version counter: a gradient edited after its push started",
    "_opt_called": "tells LR schedulers that the wrapped optimizer stepped",
    "_wrapped_by_lr_sched": "the flag torch's LR schedulers set on a wrapped optimizer.step",
    "_per_optimizer_states": "GradScaler's per-optimizer record of found_inf",
}


def _package_folders() -> dict[str, Path]:
    """Every folder with an ``__init__.py`` under a mapped top-level folder, by its ``shardps.*`` name."""
    found = {}
    for name, folder in PACKAGE_DIRS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder).parts
            found[".".join((name, *rel))] = init.parent
    return found


def _product_modules() -> list[Path]:
    return sorted(p for folder in _package_folders().values() for p in folder.glob("*.py")
                  if not p.name.endswith(("_pb2.py", "_pb2_grpc.py")))


def test_every_package_folder_is_installed_under_shardps() -> None:
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    found = set(_package_folders())
    assert found == listed, f"pyproject.toml packages: add {sorted(found - listed)}, drop {sorted(listed - found)}"
    assert all(name == "shardps" or name.startswith("shardps.") for name in listed)


def test_import_linter_contracts_hold(tmp_path: Path) -> None:
    # grimp builds its graph from one importable root package: lay the packages out as a wheel installs them
    for name, folder in PACKAGE_DIRS.items():
        shutil.copytree(REPO / folder, tmp_path.joinpath(*name.split(".")), dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    lint = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([lint, str(REPO / "pyproject.toml"), "--no-cache"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    report = out.stdout + out.stderr
    assert out.returncode == 0, report
    contracts = PYPROJECT["tool"]["importlinter"]["contracts"]
    assert report.count(" KEPT") == len(contracts) >= 3, report


def test_no_module_reaches_into_private_names() -> None:
    found = []
    for path in _product_modules():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                found += [f"{path.relative_to(REPO)}:{node.lineno}: from {node.module} import {a.name}"
                          for a in node.names if a.name.startswith("_") and node.module != "__future__"]
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                continue
            if node.attr in TORCH_PRIVATE:
                continue
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "offer these on purpose (a public name) instead:\n" + "\n".join(found)


def test_rooms_stay_small() -> None:
    too_many = {name: n for name, folder in _package_folders().items()
                if (n := len([p for p in folder.glob("*.py") if p.name != "__init__.py"])) > 15}
    assert not too_many, f"rooms over 15 modules (split them): {too_many}"
    too_long = {str(p.relative_to(REPO)): n for p in _product_modules()
                if (n := len(p.read_text().splitlines())) > 550 and not p.name.endswith(".pyi")}
    assert not too_long, f"modules over 550 lines (split them): {too_long}"


def test_nothing_imports_a_bare_top_level_folder() -> None:
    bare = ("proto", "common", "server", "worker", "cli", "apps", "api")
    found = []
    for folder in ("api", "proto", "common", "server", "worker", "cli", "apps", "tests", "benchmarks", "examples",
                   "deploy"):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
                found += [f"{path.relative_to(REPO)}:{node.lineno}: {n}" for n in names
                          if n.split(".")[0] in bare and not (path.parent / f"{n.split('.')[0]}.py").exists()]
    assert not found, "import through the shardps namespace:\n" + "\n".join(found)
