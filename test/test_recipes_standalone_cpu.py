"""A recipe is one file: what a user copies runs with the building blocks alone.

For each recipe and twin in that shape (``STANDALONE``: those with a ``__main__``): it imports from the project only
the building blocks (``kraken._ptx_utils``, ``kraken._gemm_core``, ``kraken._blocks``); copied with them into an
empty directory it imports there. The building blocks import nothing
else of the project and stay small. (Running a recipe's ``__main__`` needs GPUs: ``torchrun --nproc-per-node N``.)
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCKS = ("kraken/_ptx_utils", "kraken/_gemm_core.py", "kraken/_blocks")
ALLOWED = {"kraken._ptx_utils", "kraken._gemm_core", "kraken._blocks"}
RECIPE_DIRS = ("kraken/comm", "kraken/fused", "helion_ports/comm", "helion_ports/fused")
BLOCKS_MAX_LINES = 1500


def has_main(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(isinstance(node, ast.If) and ast.unparse(node.test) in
               ('__name__ == "__main__"', "__name__ == '__main__'") for node in tree.body)


# The recipes and twins in their one-file shape: those with a ``__main__``.
STANDALONE = [str(f.relative_to(ROOT)) for d in RECIPE_DIRS for f in sorted((ROOT / d).glob("*.py"))
              if f.name != "__init__.py" and has_main(f)]


def python_files(path: str) -> list[Path]:
    full = ROOT / path
    return sorted(full.rglob("*.py")) if full.is_dir() else [full]


def project_imports(path: Path) -> set[str]:
    """The project modules ``path`` imports (absolute names; a relative import resolved against its package)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            names = [base]
        else:
            continue
        found.update(n for n in names if n.split(".")[0] in ("kraken", "helion_ports", "benchmark"))
    return found


def outside(imports: set[str]) -> set[str]:
    return {name for name in imports if not any(name == a or name.startswith(a + ".") for a in ALLOWED)}


@pytest.mark.parametrize("recipe", STANDALONE)
def test_a_recipe_imports_only_the_building_blocks(recipe):
    assert not outside(project_imports(ROOT / recipe)), recipe


def test_every_recipe_and_twin_is_in_the_one_file_shape():
    files = [str(f.relative_to(ROOT)) for d in RECIPE_DIRS for f in sorted((ROOT / d).glob("*.py"))
             if f.name != "__init__.py"]
    assert len(files) >= 36 and files == STANDALONE, sorted(set(files) - set(STANDALONE))


def test_the_recipe_packages_import_nothing():
    """``kraken/comm/__init__.py`` and the like hold no imports: importing a recipe loads no other."""
    for d in RECIPE_DIRS:
        assert not project_imports(ROOT / d / "__init__.py"), d


def test_every_standalone_recipe_copied_alone_with_the_blocks_imports(tmp_path):
    """Each recipe and twin, copied with the building blocks into an empty directory (no ``kraken/__init__.py``: a
    namespace package), imports there, loading no project module but the building blocks and itself."""
    for path in (*BLOCKS, *STANDALONE):
        source, target = ROOT / path, tmp_path / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, target)
    assert not (tmp_path / "kraken" / "__init__.py").exists()
    modules = [path.removesuffix(".py").replace("/", ".") for path in STANDALONE]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    module = importlib.import_module(name)\n"
        "    assert callable(module.main), name\n"
        "    loaded = sorted(m for m in sys.modules if m.startswith(('kraken.', 'helion_ports.')) and not "
        "m.startswith(('kraken._ptx_utils', 'kraken._gemm_core', 'kraken._blocks')) and m not in "
        f"('kraken.comm', 'kraken.fused', 'helion_ports.comm', 'helion_ports.fused') and m not in {modules!r})\n"
        "    assert not loaded, (name, loaded)\n"
        "print('imported', len(sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "imported" in result.stdout


def test_the_one_shot_recipe_plans_alone():
    from kraken.comm import one_shot_all_reduce as r

    for numel, ws in ((1, 1), (10007, 2), (1 << 20, 8), (3 << 30, 4)):
        cfg = r.plan(numel, ws, {}, pad_bytes=9216)
        assert 1 <= cfg["num_blocks"] <= 9216 // 4 // ws, cfg
        assert cfg["chunk"] % cfg["block_size"] == 0 and cfg["num_blocks"] * cfg["chunk"] >= numel, cfg
        assert cfg["wide"] == (numel > 2**31 - 1)


def test_the_building_blocks_import_nothing_else_of_the_project():
    for path in BLOCKS:
        for file in python_files(path):
            assert not outside(project_imports(file)), file


def test_the_building_blocks_stay_small():
    lines = sum(len(file.read_text().splitlines()) for path in BLOCKS for file in python_files(path))
    assert lines <= BLOCKS_MAX_LINES, f"the building blocks have {lines} lines (at most {BLOCKS_MAX_LINES})"
