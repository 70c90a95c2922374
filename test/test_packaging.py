"""What the wheel installs is what the installed files name: the man pages,
the unit files and the service's messages send an admin to documents and
examples under the installation's prefix, never to a checkout's ``docs/``
or ``etc/`` (review session 34 A6). Read from pyproject.toml, offline;
test/test_wheel.py builds and installs the wheel itself."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DATA_FILES = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
    "data-files"
]
#: What the installed files may send an admin to: each installed path.
INSTALLED = {
    f"{directory}/{Path(source).name}"
    for directory, sources in DATA_FILES.items()
    for source in sources
}
#: A document named as installed, in any text the wheel ships.
INSTALLED_DOCUMENT = re.compile(r"share/doc/sdexec/([\w.-]+\.md)")


def test_every_document_is_installed():
    documents = sorted(str(path.relative_to(REPO)) for path in REPO.glob("docs/*.md"))
    assert sorted(DATA_FILES["share/doc/sdexec"]) == documents


def shipped_texts() -> dict[str, str]:
    """The installed man pages and examples, and the package's sources."""
    sources = [
        *(source for sources in DATA_FILES.values() for source in sources),
        *(str(path.relative_to(REPO)) for path in REPO.glob("sdexec/**/*.py")),
    ]
    return {
        source: (REPO / source).read_text()
        for source in sources
        if not source.startswith("docs/")
    }


def test_the_man_pages_name_installed_paths_not_the_checkout_s():
    for page in ("share/man/man1/sdexec.1", "share/man/man5/sdexec.toml.5"):
        text = (REPO / page).read_text().replace("\\-", "-")
        assert re.search(r"(?<![\w/.])(docs|etc)/", text) is None, page
        assert ".SH FILES" in text, page


@pytest.mark.parametrize("unit", ["sdexec.service", "sdexec-system.service"])
def test_the_units_documentation_is_the_installed_man_pages(unit):
    text = (REPO / "etc" / unit).read_text()
    (line,) = (line for line in text.splitlines() if line.startswith("Documentation="))
    pages = re.findall(r"man:([\w.-]+)\((\d)\)", line)
    assert pages
    for name, section in pages:
        assert f"share/man/man{section}/{name}.{section}" in INSTALLED, name


def test_every_document_a_shipped_file_names_is_installed():
    named = {
        (source, document)
        for source, text in shipped_texts().items()
        for document in INSTALLED_DOCUMENT.findall(text)
    }
    # The GPU hint of the mapper (sdexec/map/topology.py) is one of them.
    assert ("sdexec/map/topology.py", "operating.md") in named
    for source, document in named:
        assert f"share/doc/sdexec/{document}" in INSTALLED, (source, document)


def _paragraphs(text: str) -> list[str]:
    """``text`` cut at blank lines and at the start of each list item."""
    return [
        paragraph
        for block in re.split(r"\n\s*\n", text)
        for paragraph in re.split(r"\n(?=- )", block)
    ]


@pytest.mark.parametrize(
    "source",
    [
        "README.md",
        *(
            str(path.relative_to(REPO))
            for path in sorted(REPO.glob("docs/*.md"))
            if path.name != "performance.md"
        ),
        *(str(path.relative_to(REPO)) for path in sorted(REPO.glob("etc/*.service"))),
    ],
)
def test_a_venv_s_twistd_in_exec_start_comes_with_its_sdexec_in_exec_reload(source):
    """The units reload with ``ExecReload=/usr/bin/env sdexec reload``: an
    admin told to point ``ExecStart`` at a venv's ``bin/twistd`` (the
    manager's ``PATH`` lacks it) and not ``ExecReload`` at its
    ``bin/sdexec`` gets a ``systemctl reload`` that fails, ``/usr/bin/env:
    'sdexec': No such file or directory``, the configuration unread."""
    for paragraph in _paragraphs((REPO / source).read_text()):
        if "bin/twistd" in paragraph:
            assert "bin/sdexec" in paragraph, (source, paragraph)
