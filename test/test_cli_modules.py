"""The command line's modules, offline: what ``sdexec.cli`` and
``sdexec.cli_background`` share is ``sdexec.cliio``'s public API, not each
other's private names, and the command's start-up loads neither Twisted nor
the background commands."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import sdexec

PACKAGE = Path(sdexec.__file__).parent


def _imports(path: Path, module_level: bool) -> list[ast.ImportFrom | ast.Import]:
    """The import statements of ``path``: those its body runs on import
    (``module_level``), or all of them, those inside functions too."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if module_level else list(ast.walk(tree))
    return [node for node in nodes if isinstance(node, ast.Import | ast.ImportFrom)]


def _modules(nodes: list[ast.ImportFrom | ast.Import]) -> set[str]:
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif node.module:
            names.add(node.module)
    return names


def test_no_module_imports_another_s_private_names():
    borrowed = {
        f"{path.relative_to(PACKAGE)}: {node.module}.{alias.name}"
        for path in PACKAGE.rglob("*.py")
        for node in _imports(path, module_level=False)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sdexec")
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    }
    assert borrowed == set()


def test_the_background_commands_do_not_import_the_command_line():
    imported = _modules(_imports(PACKAGE / "cli_background.py", module_level=False))
    assert "sdexec.cliio" in imported
    assert "sdexec.cli" not in imported


def test_the_command_line_loads_the_background_commands_only_when_used():
    # Dispatching to them is the one way the two are joined, and it waits
    # for `run --bg`, `wait` or `attach`: `run` must not pay for them.
    cli = PACKAGE / "cli.py"
    assert "sdexec.cli_background" not in _modules(_imports(cli, module_level=True))
    assert "sdexec.cli_background" in _modules(_imports(cli, module_level=False))


def test_the_command_line_starts_on_the_standard_library_alone():
    # -S: no site-packages, so anything else it imported would fail here.
    listed = subprocess.run(
        [sys.executable, "-S", "-c", "import sys, sdexec.cli; print(*sys.modules)"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)},
        check=True,
        timeout=60,
    )
    loaded = set(listed.stdout.split())
    assert "sdexec.cliio" in loaded
    assert loaded.isdisjoint({"sdexec.cli_background", "twisted", "OpenSSL", "typing"})


def test_the_early_exec_is_sent_before_the_heavier_modules_load():
    # Its head start is what the command line's imports would take: enum
    # (which signal, re, json and sdexec.protocol load) is a third of it.
    listed = subprocess.run(
        [sys.executable, "-S", "-c", "import sys, sdexec.console, sdexec.earlyexec;"
         " print(*sys.modules)"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)},
        check=True,
        timeout=60,
    )  # fmt: skip
    loaded = set(listed.stdout.split())
    assert "sdexec.runrequest" in loaded
    slow = {"enum", "re", "json", "signal", "argparse", "socket", "sdexec.protocol"}
    assert loaded.isdisjoint(slow)


def test_the_commands_print_only_through_the_checked_writer():
    # A bare print() to a full stdout said "unexpected error: OSError", a
    # bug's words, where cliio.print_out says "cannot write stdout: …".
    printing = {
        f"{name}:{node.lineno}"
        for name in ("cli.py", "cli_background.py")
        for node in ast.walk(ast.parse((PACKAGE / name).read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "print"
    }
    assert printing == set()
