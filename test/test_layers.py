"""The systemd boundary: only sdexec/systemd/bus.py imports dbus-fast or
asyncio, and the systemd layer imports nothing of the service above it
(docs/design.md)."""

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


#: The sdexec modules outside sdexec/systemd/ that the systemd layer may
#: import: pure leaves, importing no more than each other, with no state and
#: no knowledge of requests, configuration or clients.
SYSTEMD_LAYER_LEAVES = {
    # The D-Bus typing of unit properties, which the bus client sends and
    # errors.py names in a refusal's explanation.
    "sdexec.property",
    # What property.py parses with: CPU and node lists, memory sizes, the
    # value syntaxes of systemd's other typed properties, signals; what a
    # unit's file can keep.
    "sdexec.idset",
    "sdexec.unitfile",
    "sdexec.sizes",
    "sdexec.propertyvalues",
    "sdexec.signals",
    # quoted() for the values in an error message; idset and ioencode use it.
    "sdexec.refusal",
    # The manager's version read from its Version property, which errors.py
    # needs to say that a refusal comes from a manager too old.
    "sdexec.managerversion",
    # systemd's names for exit statuses, which unit.py says a failure with
    # and propertyvalues.py reads SuccessExitStatus= with.
    "sdexec.exitstatus",
    # Output split into lines, which the output channel does as it reads.
    "sdexec.ioencode",
}


def module_path(name: str) -> Path | None:
    """The file of sdexec module ``name``, or None if it is no module."""
    base = PACKAGE.joinpath(*name.split(".")[1:])
    for path in (base / "__init__.py", base.with_name(base.name + ".py")):
        if path.is_file():
            return path
    return None


def sdexec_imports(path: Path) -> set[str]:
    """The sdexec modules a file imports anywhere in its body: at module
    level, in functions, under ``TYPE_CHECKING``; ``from P import m`` of a
    submodule ``m`` counts as ``P.m``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {
        name
        for name in names
        if name.split(".")[0] == "sdexec" and module_path(name) is not None
    }


def reached_from(roots: set[str]) -> set[str]:
    """Every sdexec module that importing ``roots`` can load."""
    reached: set[str] = set()
    pending = set(roots)
    while pending:
        name = pending.pop()
        reached.add(name)
        path = module_path(name)
        assert path is not None, name
        pending |= sdexec_imports(path) - reached
    return reached


def systemd_layer() -> set[str]:
    return {
        "sdexec." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        for path in (PACKAGE / "systemd").glob("*.py")
    }


def test_the_systemd_layer_imports_only_leaves_of_the_service():
    layer = systemd_layer()
    outside = {
        name
        for name in reached_from(layer)
        if name != "sdexec" and name.split(".")[:2] != ["sdexec", "systemd"]
    }
    assert sorted(outside - SYSTEMD_LAYER_LEAVES) == []


def test_the_layer_check_sees_imports_in_functions(tmp_path):
    source = tmp_path / "late.py"
    source.write_text("def f():\n    from sdexec.config import Config\n")
    assert sdexec_imports(source) == {"sdexec.config"}


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
