"""The systemd boundary: only sdexec/systemd/bus.py imports dbus-fast or
asyncio (docs/design.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import sdexec

PACKAGE = Path(sdexec.__file__).parent
BUS_ONLY = ("asyncio", "dbus_fast")
ALLOWED = {PACKAGE / "systemd" / "bus.py"}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_only_the_bus_module_imports_dbus_fast_or_asyncio():
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(
            name for name in imported_modules(path) if name.split(".")[0] in BUS_ONLY
        )
        for path in PACKAGE.rglob("*.py")
        if path not in ALLOWED
    }
    assert {path: names for path, names in offenders.items() if names} == {}


def test_the_check_sees_the_bus_module_import():
    assert {"asyncio", "dbus_fast"} <= {
        name.split(".")[0] for name in imported_modules(PACKAGE / "systemd" / "bus.py")
    }


def exported_exceptions(path: Path) -> set[str]:
    """Exception classes a module lists in ``__all__``."""
    tree = ast.parse(path.read_text(), str(path))
    exported: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "__all__"
            for target in node.targets
        ):
            exported = set(ast.literal_eval(node.value))
    return {
        node.name
        for node in tree.body
        if isinstance(node, ast.ClassDef)
        and node.name in exported
        and (node.name.endswith("Error") or node.name.endswith("Exception"))
    }


def instantiated_names(path: Path) -> set[str]:
    """Names called in a module (an error is made to be raised or errbacked)."""
    return {
        node.func.id
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }


def test_every_exported_error_is_made_somewhere():
    sources = list(PACKAGE.rglob("*.py"))
    exported = set().union(*(exported_exceptions(path) for path in sources))
    made = set().union(*(instantiated_names(path) for path in sources))
    assert exported, "the check found no exported error classes"
    assert exported - made == set()
