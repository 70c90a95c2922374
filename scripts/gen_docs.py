#!/usr/bin/env python3
"""Generate the installed documentation under share/ from its sources.

    python3 scripts/gen_docs.py          # rewrite the files under share/
    python3 scripts/gen_docs.py --check  # exit 1 if any is out of date

- ``share/man/man1/sdexec.1``: from the ``sdexec`` argparse parser
  (argparse-manpage), with the sections of ``scripts/sdexec.1.include``;
- ``share/man/man5/sdexec.toml.5``: from ``docs/configuration.md``, by the
  small Markdown-to-roff converter below (that file uses headings,
  paragraphs, lists, tables, code blocks and inline code, nothing more);
- ``share/bash-completion/completions/sdexec`` and
  ``share/zsh/site-functions/_sdexec``: from the same parser (shtab).

The outputs are committed and shipped in the wheel (pyproject.toml
``data-files``); ``test/test_docs.py`` fails when one is stale, so a change
to the parser or to docs/configuration.md comes with a run of this script.
Generation needs the test extra's argparse-manpage and shtab; the installed
package does not.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import shtab  # noqa: E402
from argparse_manpage.manpage import Manpage  # noqa: E402

from sdexec.cliargs import build_parser  # noqa: E402

SUMMARY = "run processes as transient systemd units"


def _version() -> str:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def sdexec_1() -> str:
    """sdexec(1), from the command's parser."""
    version = _version()
    page = Manpage(
        build_parser(),
        {
            "project_name": "sdexec",
            "version": version,
            "date": version,  # a fixed value keeps the page reproducible
            "description": SUMMARY,
            "manual_section": "1",
            "manual_title": "sdexec manual",
            "include": str(REPO / "scripts" / "sdexec.1.include"),
        },
    )
    return str(page)


def completion(shell: str) -> str:
    script = shtab.complete(build_parser(), shell=shell)
    return _remainder_ends_options(script) if shell == "bash" else script


#: Where shtab's bash loop looks at each word typed before the one being
#: completed.
_EACH_WORD = """    local this_word="${COMP_WORDS[$word_index]}"
"""
#: shtab's bash offered `run`'s options after the command word too (`sdexec
#: run ls -<TAB>` gave --dir, --bg...), which would go to the command: its
#: zsh script stops there. Once a word fills a positional that takes the
#: rest of the line (argparse's REMAINDER, nargs "..."), what follows is
#: treated as after "--".
_REMAINDER_STOP = """    if [[ $current_action_is_positional = true &&
          "$current_action_nargs" == "..." && "$this_word" != -* ]]; then
      pos_only=1 # the command word: the rest of the line is the command's
    fi
"""


def _remainder_ends_options(script: str) -> str:
    if _EACH_WORD not in script:
        raise SystemExit("gen_docs: shtab's bash script changed: see _EACH_WORD")
    return script.replace(_EACH_WORD, _EACH_WORD + _REMAINDER_STOP, 1)


# -- docs/configuration.md to sdexec.toml(5) ------------------------------

_INLINE = [
    (re.compile(r"\[([^\]]+)\]\([^)]+\)"), r"\1"),  # links: their text
    (re.compile(r"\*\*([^*]+)\*\*"), r"\\fB\1\\fR"),
    (re.compile(r"`([^`]+)`"), r"\\fB\1\\fR"),
]


def _escape(text: str) -> str:
    text = text.replace("\\", "\\e").replace("-", "\\-")
    # non-ASCII (…, ≥, →) as groff's Unicode escapes: no preconv needed
    return "".join(c if ord(c) < 128 else f"\\[u{ord(c):04X}]" for c in text)


def _inline(text: str) -> str:
    text = _escape(text)
    for pattern, replacement in _INLINE:
        text = pattern.sub(replacement, text)
    if text.startswith((".", "'")):  # roff would read a control line
        text = "\\&" + text
    return text


def _table(rows: list[str]) -> list[str]:
    """A table as a tagged list (a man page is 80 columns; tables of keys
    read better as .TP entries): the first cell is the tag, the middle cells
    a "header: value" line, the last cell the paragraph."""
    header, *cells = [
        [cell.strip() for cell in row.strip().strip("|").split("|")]
        for row in rows
        if not re.fullmatch(r"\|[\s\-|:]+\|", row.strip())
    ]
    out = []
    for first, *middle, last in cells:
        out += [".TP", _inline(first), ".br"]  # the body below the tag, always
        details = "; ".join(
            f"{name}: {value}"
            for name, value in zip(header[1:-1], middle, strict=True)
            if value
        )
        if details:
            out += [_inline(details), ".br"]
        out.append(_inline(last))
    return out


def _heading(line: str) -> list[str]:
    level = len(line) - len(line.lstrip("#"))
    text = _inline(line.lstrip("#").strip())
    return [f".SH {text.upper()}" if level <= 2 else f".SS {text}"]


def markdown_to_roff(markdown: str) -> list[str]:
    """The body of a man page from Markdown (the first heading dropped: the
    page's NAME says it)."""
    lines = markdown.splitlines()[1:]
    out: list[str] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.lstrip().startswith("```"):  # also indented, inside a list item
            indent = len(line) - len(line.lstrip())
            end = index + 1
            while lines[end].strip() != "```":
                end += 1
            code = [_escape(text[indent:]) for text in lines[index + 1 : end]]
            out += [".IP" if indent else ".PP", ".RS 4", ".nf", *code, ".fi", ".RE"]
            index = end + 1
        elif line.startswith("#"):
            out += _heading(line)
            index += 1
        elif line.startswith("|"):
            end = index
            while end < len(lines) and lines[end].startswith("|"):
                end += 1
            out += _table(lines[index:end])
            index = end
        elif line.startswith("- "):
            item = [line[2:]]
            index += 1
            while (
                index < len(lines)
                and lines[index].startswith("  ")
                and not lines[index].lstrip().startswith("```")
            ):
                item.append(lines[index].strip())
                index += 1
            out += [".IP \\(bu 2", _inline(" ".join(item))]
        elif line.strip():
            paragraph = []
            while (
                index < len(lines)
                and lines[index].strip()
                and not lines[index].lstrip().startswith(("#", "|", "- ", "```"))
            ):
                paragraph.append(lines[index].strip())
                index += 1
            out += [".PP", _inline(" ".join(paragraph))]
        else:
            index += 1
    return out


#: The checkout's paths that docs/configuration.md names, as the wheel
#: installs them under its prefix (a venv's directory, /usr/local): the page
#: is read where there is no checkout. Not ``/etc/sdexec.toml``.
_INSTALLED_PATHS = [
    (re.compile(r"(?<![\w/.])docs/"), "share/doc/sdexec/"),
    (re.compile(r"(?<![\w/.])etc/(?=sdexec)"), "share/sdexec/examples/"),
]


def _as_installed(markdown: str) -> str:
    for checkout, installed in _INSTALLED_PATHS:
        markdown = checkout.sub(installed, markdown)
    return markdown


def sdexec_toml_5() -> str:
    version = _version()
    configuration = (REPO / "docs" / "configuration.md").read_text()
    body = markdown_to_roff(_as_installed(configuration))
    return "\n".join([
        f'.TH SDEXEC.TOML 5 "{version}" "sdexec {version}" "sdexec manual"',
        ".SH NAME",
        "sdexec.toml \\- sdexec configuration file",
        ".SH SYNOPSIS",
        "\\fI/etc/sdexec/sdexec.toml\\fR, \\fI~/.config/sdexec/sdexec.toml\\fR"
        " (or \\fI.yaml\\fR), given with \\fBtwistd sdexec \\-\\-config\\fR",
        *body,
        ".SH FILES",
        "Under the prefix sdexec is installed in (a venv's directory, or",
        "\\fI/usr/local\\fR):",
        "\\fIshare/sdexec/examples/\\fR holds the example files and the unit files;",
        "\\fIshare/doc/sdexec/\\fR the documents named \\fI*.md\\fR here.",
        ".SH SEE ALSO",
        "\\fBsdexec\\fR(1), \\fBtwistd\\fR(1), \\fBflux-config-exec\\fR(5),"
        " \\fBsystemd.resource-control\\fR(5)",
        "",
    ])  # fmt: skip


OUTPUTS = {
    "share/man/man1/sdexec.1": sdexec_1,
    "share/man/man5/sdexec.toml.5": sdexec_toml_5,
    "share/bash-completion/completions/sdexec": lambda: completion("bash"),
    "share/zsh/site-functions/_sdexec": lambda: completion("zsh"),
}


def stale() -> list[str]:
    """The outputs whose committed text differs from a fresh generation."""
    return [
        path
        for path, generate in OUTPUTS.items()
        if not (REPO / path).exists() or (REPO / path).read_text() != generate()
    ]


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        out_of_date = stale()
        for path in out_of_date:
            print(f"{path} is out of date: run scripts/gen_docs.py", file=sys.stderr)
        return 1 if out_of_date else 0
    for path, generate in OUTPUTS.items():
        target = REPO / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(generate())
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
