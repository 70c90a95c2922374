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
            name
            for name in imported_modules(path)
            if name.split(".")[0] in BUS_ONLY
        )
        for path in PACKAGE.rglob("*.py")
        if path not in ALLOWED
    }
    assert {path: names for path, names in offenders.items() if names} == {}


def test_the_check_sees_the_bus_module_import():
    assert {"asyncio", "dbus_fast"} <= {
        name.split(".")[0] for name in imported_modules(PACKAGE / "systemd" / "bus.py")
    }
