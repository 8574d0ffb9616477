"""The floors of `specpilot/` and their import rules, checked on every import statement (function-local
ones included): cli -> agent -> memory -> compiler -> passes -> schedules -> kernels -> core, each
floor importing only floors below it; runtime imports core alone; serve (the HTTP server) imports
runtime and core, and only cli imports it; no module imports or uses another's
private name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "specpilot"
FLOORS = ["core", "kernels", "schedules", "passes", "compiler", "memory", "agent", "cli"]
RUNTIME_USERS = {"agent", "cli", "serve"}      # the floors that drive builds and may run them
NARROW = {"runtime": {"core"},         # runs builds with the TVM runtime alone
          "serve": {"core", "runtime"},   # the HTTP server drives the runtime, nothing that compiles
          "memory": {"core", "passes"}}   # the reproduce check (a compiler call) is handed in by the agent


def floor_of(module: str) -> str:
    """'specpilot.kernels.gdn' -> 'kernels'; 'specpilot.cli' -> 'cli'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "specpilot"


def allowed(importer: str, imported: str) -> bool:
    if importer == imported:
        return True
    if importer in NARROW:
        return imported in NARROW[importer]
    if imported == "runtime":
        return importer in RUNTIME_USERS
    if imported == "serve":
        return importer == "cli"
    if importer not in FLOORS or imported not in FLOORS:
        return False
    return FLOORS.index(imported) < FLOORS.index(importer)


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path):
    """(imported module, names, line) for every specpilot import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path).split(".") if path.name == "__init__.py" else module_name(path).split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            if base == "specpilot":      # `from specpilot import kernels`
                for alias in node.names:
                    yield f"specpilot.{alias.name}", [], node.lineno
            elif base.startswith("specpilot."):
                yield base, [a.name for a in node.names], node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("specpilot."):
                    yield alias.name, [], node.lineno


def all_modules():
    return sorted(p for p in PACKAGE.rglob("*.py"))


def test_floors_exist():
    present = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert set(FLOORS) - {"cli"} <= present and "runtime" in present


@pytest.mark.parametrize("path", all_modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path):
    importer = floor_of(module_name(path))
    wrong = [f"line {line}: {module} ({floor_of(module)})" for module, _, line in imports(path)
             if not allowed(importer, floor_of(module))]
    assert not wrong, f"{path.relative_to(PACKAGE)} ({importer}) imports upward or sideways: {wrong}"


@pytest.mark.parametrize("path", all_modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_private_names_across_modules(path):
    own = module_name(path)
    private = [f"line {line}: {module}.{name}" for module, names, line in imports(path) if module != own
               for name in names if name.startswith("_")]
    private += private_attributes(path)
    assert not private, f"{path.relative_to(PACKAGE)} uses private names of other modules: {private}"


def is_module(dotted: str) -> bool:
    base = PACKAGE.parent.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def module_aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> specpilot module for every import that binds a module (``import specpilot.a.b as m``,
    ``from specpilot.a import b``)."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("specpilot.") and a.asname:
                    aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("specpilot"):
            for a in node.names:
                if is_module(f"{node.module}.{a.name}"):
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    return aliases


def private_attributes(path: Path) -> list[str]:
    return private_uses(path.read_text(), module_name(path))


def private_uses(source: str, own: str) -> list[str]:
    """``m._name`` where ``m`` is another specpilot module bound by an import in ``source``."""
    tree = ast.parse(source)
    aliases = module_aliases(tree)
    return [f"line {n.lineno}: {aliases[n.value.id]}.{n.attr}" for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases
            and aliases[n.value.id] != own and n.attr.startswith("_") and not n.attr.startswith("__")]


def test_private_attributes_are_found():
    source = ("from specpilot.runtime import engine\nimport specpilot.core.files as f\n"
              "engine._x(); f._umask(); engine.__name__; f.atomic_write_text\n")
    assert private_uses(source, "specpilot.runtime.batching") == [
        "line 3: specpilot.runtime.engine._x", "line 3: specpilot.core.files._umask"]
    assert private_uses(source, "specpilot.core.files") == ["line 3: specpilot.runtime.engine._x"]


def test_rules_reject_what_they_should():
    assert not allowed("runtime", "compiler") and not allowed("runtime", "kernels")
    assert not allowed("kernels", "passes") and not allowed("memory", "compiler")
    assert not allowed("core", "kernels") and allowed("compiler", "core") and allowed("agent", "runtime")
    assert not allowed("compiler", "runtime")
