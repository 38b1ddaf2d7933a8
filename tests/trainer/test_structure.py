"""Structure rules checked on the source (ast, no imports): no import circle anywhere in verl_agent (function-level
and TYPE_CHECKING imports count), and in trainer/ and models/ no function over 60 lines, no class over 20 public
methods, every class documented."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "verl_agent"


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), str(path))
    return out


def _imports(name: str, tree: ast.Module, modules: dict) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                      for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    # a package's own lazy re-exports (__init__ -> its submodules) are not a dependency of the package's users
    return {m for m in found if m in modules and m != name and not m.startswith(name + ".")}


def test_no_import_circles():
    modules = _modules()
    graph = {name: _imports(name, tree, modules) for name, tree in modules.items()}
    circles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert circles == []


def test_trainer_and_models_sizes():
    problems = []
    for area in ("trainer", "models"):
        for path in sorted((PACKAGE / area).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                where = f"{path.relative_to(PACKAGE.parent)}:{node.__dict__.get('lineno')}"
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                    problems.append(f"{where} {node.name}: {node.end_lineno - node.lineno + 1} lines")
                if isinstance(node, ast.ClassDef):
                    public = [b for b in node.body if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))
                              and not b.name.startswith("_")]
                    if len(public) > 20:
                        problems.append(f"{where} {node.name}: {len(public)} public methods")
                    if not ast.get_docstring(node):
                        problems.append(f"{where} {node.name}: no docstring")
    assert problems == []
