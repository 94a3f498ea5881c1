"""A recipe is one file: what a user copies runs with the building blocks alone.

For each recipe of ``STANDALONE``: it imports from the project only the building blocks (``kraken._ptx_utils``,
``kraken._gemm_core``, ``kraken._blocks``); copied alone with them into an empty directory it imports and plans
(no ``kraken/__init__.py``: a namespace package); it has a ``__main__`` block. The building blocks import nothing
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
BLOCKS = ("kraken/_ptx_utils", "kraken/_gemm_core.py", "kraken/_blocks.py")
ALLOWED = {"kraken._ptx_utils", "kraken._gemm_core", "kraken._blocks"}
STANDALONE = ["kraken/comm/one_shot_all_reduce.py"]
BLOCKS_MAX_LINES = 1500


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


@pytest.mark.parametrize("recipe", STANDALONE)
def test_a_recipe_has_a_main_block(recipe):
    tree = ast.parse((ROOT / recipe).read_text())
    mains = [node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) in
             ('__name__ == "__main__"', "__name__ == '__main__'")]
    assert mains, f"{recipe}: no `if __name__ == \"__main__\":` block"


@pytest.mark.parametrize("recipe", STANDALONE)
def test_a_recipe_copied_alone_with_the_blocks_imports_and_plans(recipe, tmp_path):
    for path in (*BLOCKS, recipe):
        source, target = ROOT / path, tmp_path / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, target)
    assert not (tmp_path / "kraken" / "__init__.py").exists()
    module = recipe.removesuffix(".py").replace("/", ".")
    code = (
        f"import sys, {module} as r\n"
        "assert all(m == 'kraken' or not m.startswith('kraken.') or m.startswith(('kraken._ptx_utils', "
        "'kraken._gemm_core', 'kraken._blocks', 'kraken.comm', 'kraken.fused')) for m in sys.modules), "
        "sorted(m for m in sys.modules if m.startswith('kraken'))\n"
        "assert callable(r.main) and callable(r.launch)\n"
        "for numel, ws in ((1, 1), (10007, 2), (1 << 20, 8), (3 << 30, 4)):\n"
        "    cfg = r.plan(numel, ws, {}, pad_bytes=9216)\n"
        "    assert 1 <= cfg['num_blocks'] <= 9216 // 4 // ws, cfg\n"
        "    assert cfg['chunk'] % cfg['block_size'] == 0 and cfg['num_blocks'] * cfg['chunk'] >= numel, cfg\n"
        "    assert cfg['wide'] == (numel > 2**31 - 1)\n"
        "print('planned', r.plan(10007, 2, {}, pad_bytes=9216))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "planned" in result.stdout


def test_the_building_blocks_import_nothing_else_of_the_project():
    for path in BLOCKS:
        for file in python_files(path):
            assert not outside(project_imports(file)), file


def test_the_building_blocks_stay_small():
    lines = sum(len(file.read_text().splitlines()) for path in BLOCKS for file in python_files(path))
    assert lines <= BLOCKS_MAX_LINES, f"the building blocks have {lines} lines (at most {BLOCKS_MAX_LINES})"
