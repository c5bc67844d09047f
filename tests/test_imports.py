"""Module boundaries, read from the import graph: every `import` of every module under src/bertrain (at any nesting
level: a function-local import counts the same as one at the top), and the test files' imports of each other.

The direction (ARCHITECTURE.md): utils and config at the bottom; model, data, train and tasks above them; deploy
(inference: Predictor, backends, ONNX export, serving), pipeline and bench above the tasks; commands and cli on top.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

from distributed import cli_env

SRC = Path(__file__).resolve().parents[1] / "src"
TESTS = Path(__file__).resolve().parent

LOWER = ("tasks", "data", "model", "train", "utils", "config")
"""Packages (and the module config.py) below deploy, pipeline and the commands."""
UPPER = ("deploy", "pipeline", "bench", "commands", "cli")


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, imported module) for every import in the file `path` of `module` (see `imports_in`)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    return imports_in(path.read_text(encoding="utf-8"), package)


def imports_in(source: str, package: str) -> list[tuple[int, str]]:
    """(line, imported module) for every import in `source`, code of a module in `package`: absolute and relative
    `import`/`from` at any depth, and `importlib.import_module("...")` / `__import__("...")` of a constant name."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            found += [(node.lineno, f"{target}.{a.name}") for a in node.names]  # `from bertrain import deploy`
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("import_module", "__import__"):
                found.append((node.lineno, node.args[0].value))
    return found


@lru_cache(maxsize=None)
def source_graph() -> tuple[tuple[str, str, int, str], ...]:
    """(importing module, its file relative to src, line, imported bertrain module) over src/bertrain."""
    edges = []
    for path in sorted((SRC / "bertrain").rglob("*.py")):
        module = _module_name(path, SRC)
        for line, target in imports_of(path, module):
            if target == "bertrain" or target.startswith("bertrain."):
                edges.append((module, str(path.relative_to(SRC)), line, target))
    return tuple(edges)


def _part(module: str) -> str:
    """The package (or top-level module) of bertrain that `module` belongs to: bertrain.tasks.squad -> tasks."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_graph_is_read():
    """The reader sees top-level, function-local and relative imports (else the tests below prove nothing)."""
    edges = source_graph()
    assert any(m == "bertrain.deploy.predict" and t.startswith("bertrain.tasks.squad") for m, _, _, t in edges)
    assert any(m.startswith("bertrain.commands.") and t.startswith("bertrain.deploy.") for m, _, _, t in edges)
    code = "def f():\n    from ..deploy import predict\n    importlib.import_module('bertrain.pipeline')\n"
    assert {t for _, t in imports_in(code, "bertrain.tasks")} == {
        "bertrain.deploy", "bertrain.deploy.predict", "bertrain.pipeline"}


@pytest.mark.parametrize("lower", LOWER)
def test_lower_packages_never_import_deploy_pipeline_or_commands(lower):
    """tasks/, data/, model/, train/, utils/ and config.py import nothing of deploy, pipeline, bench, the commands
    or the CLI, at any nesting level: the direction is deploy (and pipeline) above tasks."""
    wrong = [f"{file}:{line}: imports {target}" for module, file, line, target in source_graph()
             if _part(module) == lower and _part(target) in UPPER]
    assert not wrong, "\n".join(wrong)


def test_deploy_and_pipeline_never_import_commands():
    wrong = [f"{file}:{line}: imports {target}" for module, file, line, target in source_graph()
             if _part(module) in ("deploy", "pipeline", "bench") and _part(target) in ("commands", "cli")]
    assert not wrong, "\n".join(wrong)


def test_deploy_says_its_imports_at_the_top():
    """deploy/ imports what it uses of bertrain at module top, so the graph shows it; only the optional packages
    of the deploy extra are imported late (through `bertrain.deploy.require`)."""
    late = []
    for path in sorted((SRC / "bertrain" / "deploy").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top:
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if getattr(node, "level", 0) or any(n == "bertrain" or n.startswith("bertrain.") for n in names):
                    late.append(f"{path.relative_to(SRC)}:{node.lineno}: {ast.unparse(node)}")
    assert not late, "\n".join(late)


def test_no_test_file_imports_another():
    """Shared test code lives in helpers.py, distributed.py, deploy_fixtures.py and conftest.py, never in a test
    file that another test file imports."""
    tests = {p.stem for p in TESTS.glob("test_*.py")}
    wrong = []
    for path in sorted(TESTS.glob("*.py")):
        for line, target in imports_of(path, f"tests.{path.stem}"):
            if target.removeprefix("tests.").split(".")[0] in tests - {path.stem}:
                wrong.append(f"{path.name}:{line}: imports {target}")
    assert not wrong, "\n".join(wrong)


BLOCK_EXTRAS = """
import sys
for name in ("onnx", "onnxruntime", "onnxscript", "fastapi", "uvicorn", "httpx", "pydantic"):
    sys.modules[name] = None  # import NAME -> ImportError, as without the deploy extra
"""


def test_deploy_imports_without_the_extra_and_tasks_without_deploy():
    """Without the deploy extra, every deploy module except the server imports (the extra's packages load where
    they are used) and `bertrain --help`, `predict --help`, `serve --help`, `export --help` work; importing the
    tasks, data, model and train packages loads nothing of deploy."""
    code = BLOCK_EXTRAS + """
import bertrain.tasks.finetune, bertrain.tasks.pretraining, bertrain.tasks.evaluate, bertrain.tasks.metrics
import bertrain.data.prepare, bertrain.model.hf, bertrain.train.trainer
assert not [m for m in sys.modules if m.startswith("bertrain.deploy")], sorted(sys.modules)
import bertrain.deploy.predict, bertrain.deploy.backends, bertrain.deploy.onnx_export, bertrain.deploy.loadtest
import bertrain.deploy.config
from bertrain.cli import main
for argv in ([], ["predict"], ["serve"], ["export"]):
    try:
        main([*argv, "--help"])
    except SystemExit as e:
        assert e.code == 0, (argv, e.code)
print("imported")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=cli_env())
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "imported", r.stderr[-3000:]
