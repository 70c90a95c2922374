"""What design.md, containment.md, termination.md and mapper.md state of
the code, made from the code: the messages they quote, the numbers they
give and the mapper's command line as they show it run (review session 47).
A message or constant changed must change the sentence that states it."""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from twisted.internet.task import Clock

REPO = Path(__file__).resolve().parent.parent


def _text(document: str) -> str:
    """A document with its whitespace runs as single spaces, as a sentence
    wrapped over lines is read."""
    text = (REPO / "docs" / document).read_text(encoding="utf-8")
    return re.sub(r"\s+", " ", text)


class _Quiet:
    """A termination or stop-timer target that does nothing: only the
    words of the verdict are wanted."""

    def signal_tasks(self, signum: int) -> None:
        """Step 1 and 2's signals, not acted on."""

    def signal_main(self, signum: int) -> None:
        """Step 3's signals, not acted on."""

    def signal_all(self, signum: int) -> None:
        """The stop timer's signal, not acted on."""

    def unkillable(self, reason: str) -> None:
        """The termination's verdict, read from the sequence instead."""

    def abandon(self, reason: str) -> None:
        """The stop timer's verdict, read from the timer instead."""


def _unkillable_job_said() -> str:
    """The EDEADLK of job f1, whose time limit began its end, run out on
    kill-timeout = "1s", max-kill-count = 4, as termination.md quotes it."""
    from sdexec.termination import (
        TerminationPolicy,
        TerminationReason,
        TerminationSequence,
        unkillable_reason,
    )

    clock = Clock()
    policy = TerminationPolicy(kill_timeout=1.0, max_kill_count=4)
    sequence = TerminationSequence(clock, policy, _Quiet(), "f1")
    sequence.begin(TerminationReason.TIMEOUT)
    while sequence.next_at is not None:
        clock.advance(sequence.next_at - clock.seconds())
    return f"{unkillable_reason('f1')}: {sequence.account()}; the node is drained"


def _abandoned_unit_said() -> str:
    """What follows an abandoned unit's drain reason in its EDEADLK, on a
    10 s stop timer, as termination.md quotes it."""
    from sdexec.unitstop import StopTimer

    clock = Clock()
    stop = StopTimer(clock, 10, signal.SIGUSR1, "u.service", _Quiet(), lambda: True)
    stop.deactivating(since=0)
    clock.advance(10)
    clock.advance(10)
    return f": {stop.account()}; the node is drained"


def _quoted() -> list[tuple[str, str]]:
    """(document, what it quotes of the code), each made from the code."""
    from sdexec.devicefence import _NOT_ENFORCED
    from sdexec.leftovers import drain_reason
    from sdexec.orphans import lost_unit_reason
    from sdexec.termination import unkillable_reason
    from sdexec.unitstop import abandon_reason

    return [
        ("termination.md", _unkillable_job_said()),
        ("termination.md", _abandoned_unit_said()),
        ("termination.md", unkillable_reason("JOBID")),
        ("termination.md", abandon_reason("UNIT")),
        ("termination.md", lost_unit_reason("UNIT")),
        ("design.md", lost_unit_reason("UNIT")),
        ("design.md", f"`{abandon_reason('UNIT')}: …`"),
        ("design.md", f"reason `{drain_reason(2, True).replace('2', 'N')}`"),
        ("design.md", f"(`{drain_reason(1, False)} …`"),
        ("containment.md", _NOT_ENFORCED["user"]),
    ]  # fmt: skip


@pytest.mark.parametrize(("document", "message"), _quoted())
def test_the_documents_quote_the_code_s_verdicts(document, message):
    # termination.md's unkillable example was written by hand from the
    # account's format: its schedule (1 s, 4 attempts) and its words must be
    # what the sequence says when run.
    assert message in _text(document)


def _numbers() -> list[tuple[str, str]]:
    """(document, the phrase that states a constant), made from it."""
    from sdexec.command import DESCRIPTION_LENGTH
    from sdexec.config import MAX_KILL_INTERVAL
    from sdexec.connection import CLIENT_BUFFER_SIZE, MAX_UNANSWERED
    from sdexec.lograte import BURST
    from sdexec.lookup import IDLE_WORKER_S, MAX_STUCK
    from sdexec.orphans import _PASSES
    from sdexec.systemd.bus import MANAGER_ABSENT_S
    from sdexec.systemd.retry import FIRST_DELAY, MAX_DELAY
    from sdexec.systemd.unanswered import SILENT_AFTER_S
    from sdexec.systemd.window import DEFAULT_MAX_INFLIGHT
    from sdexec.termination import RESEND_INTERVAL

    return [
        ("termination.md", f"capped at {MAX_KILL_INTERVAL:g} s"),
        ("termination.md", f"`{RESEND_INTERVAL:g} s` apart (`RESEND_INTERVAL`"),
        ("design.md", f"cut at {DESCRIPTION_LENGTH} characters"),
        ("design.md", f"{BURST} a minute per kind"),
        ("design.md", f"(default {DEFAULT_MAX_INFLIGHT}) calls awaiting"),
        ("design.md", f"`connection.MAX_UNANSWERED` ({MAX_UNANSWERED})"),
        ("design.md", f"more than {CLIENT_BUFFER_SIZE // 1024} KiB wait"),
        ("design.md", f"within {MANAGER_ABSENT_S:g} s (`MANAGER_ABSENT_S`)"),
        ("design.md", f"({FIRST_DELAY:g} s doubling to {MAX_DELAY:g} s"),
        ("design.md", f"once a call has waited {SILENT_AFTER_S:g} s"),
        ("design.md", f"an idle one ends after {IDLE_WORKER_S:g} s"),
        ("design.md", f"Once {MAX_STUCK} threads are left so"),
        ("design.md", f"(at most {_PASSES})"),
    ]


@pytest.mark.parametrize(("document", "phrase"), _numbers())
def test_the_documents_numbers_are_the_code_s(document, phrase):
    assert phrase in _text(document)


def _cli_examples() -> list[tuple[str, str]]:
    """mapper.md's shell session: (command, what it printed), in order."""
    section = (REPO / "docs" / "mapper.md").read_text(encoding="utf-8")
    section = section[section.index("\n## CLI\n") : section.index("\n## Test data\n")]
    examples: list[tuple[str, str]] = []
    for line in section.splitlines():
        if line.startswith("    $ "):
            examples.append((line[6:], ""))
        elif examples and line.startswith("    "):
            command, printed = examples[-1]
            examples[-1] = (command, printed + line[4:] + "\n")
        elif examples and line.strip():
            break
    return examples


def test_mapper_md_s_command_line_session_runs_as_shown(tmp_path):
    # The mapper's CLI checks what a mapper returns and cuts quoted values
    # now; its documented session must still be what it prints (its
    # failure on stderr, exit 1), from a checkout, on the recorded
    # topologies.
    examples = _cli_examples()
    assert [command.split()[:3] for command, _ in examples] == [
        ["python3", "-m", "sdexec.map"],
        ["python3", "-m", "sdexec.map"],
        ["cat", "site.toml"],
        ["python3", "-m", "sdexec.map"],
    ]
    for command, printed in examples:
        if command.startswith("cat "):
            (tmp_path / "site.toml").write_text(printed, encoding="utf-8")
            continue
        words = shlex.split(command)[1:]
        words = [str(tmp_path / w) if w == "site.toml" else w for w in words]
        done = subprocess.run(
            [sys.executable, *words], cwd=REPO, capture_output=True, text=True,
            timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        failed = ": mapper failed:" in printed
        assert (done.returncode, done.stdout + done.stderr) == (int(failed), printed), (
            command
        )


def test_mapper_md_s_synopsis_is_the_command_line_s_usage():
    # It lacked -h and --version, which the command line takes.
    from sdexec.map.cli import _parser

    usage = re.sub(r"\s+", " ", _parser().format_usage()).strip()
    synopsis = usage.removeprefix("usage: ")
    assert synopsis in _text("mapper.md")
