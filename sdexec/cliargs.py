"""The ``sdexec`` command line's parser (argparse), apart from the
commands (:mod:`sdexec.cli`): a run whose exec was sent early
(:mod:`sdexec.earlyexec`) has its options already, as this parser would
give them, and does not load argparse at all.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from sdexec.cliio import MAX_PID, is_number, pid_of
from sdexec.cliparser import CommandParser
from sdexec.refusal import json_quoted
from sdexec.runrequest import is_utf8
from sdexec.signals import parse_signal
from sdexec.version import add_version_option

TYPE_CHECKING = False  # not typing's: its import slows the command line
if TYPE_CHECKING:
    from typing import Any, NoReturn

__all__ = ["build_parser", "kill_target", "named_command", "parse_args"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line; ``SystemExit(2)`` with a usage message if it
    is wrong."""
    argv = _without_options_end(sys.argv[1:] if argv is None else list(argv))
    at = _command_index(argv)
    parser = build_parser(None if at is None else argv[at], at is not None)
    if at is None:
        options = _parse_without_command(parser, argv)
    elif argv[at] == "run":
        options = _parse_run(parser, argv, at)
    else:
        if at is not None and argv[at] == "kill":
            _refuse_dashed_signal(argv[at + 1 :])
        options = _parse_command(parser, argv, argv[at])
    if options.command == "run":
        _check_run(options)
    return options


def _parse_without_command(
    parser: argparse.ArgumentParser, argv: list[str]
) -> argparse.Namespace:
    """``argv``, where no command of ours comes first, parsed by
    ``parser`` (built not requiring one): an unknown option is named
    before a missing command is. argparse checks required arguments
    first, and ``sdexec --nope`` said only "the following arguments are
    required: COMMAND", where ``sdexec --nope ps`` names ``--nope``."""
    at = _first_word(argv)
    if at is not None and not (argv[at].startswith("-") or is_utf8(argv[at])):
        _invalid_command(parser, argv[at])  # argparse showed its surrogates
    options, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.error(f"unrecognized arguments: {_words_shown(unknown)}")
    if options.command is None:
        parser.error("the following arguments are required: COMMAND")
    return options


def _parse_command(
    parser: argparse.ArgumentParser, argv: list[str], command: str
) -> argparse.Namespace:
    """``argv`` parsed, a word ``command``'s parser does not take refused
    with that command's usage, as argparse refuses its other arguments:
    argparse's subparsers leave such words to the top level, which said
    ``sdexec kill TERM 1 2``'s "unrecognized arguments: 2" with ``sdexec``'s
    usage. (Every word before the command is the top level's own: the
    command is named after ``--socket`` only.)

    A word it does not take is named before a missing argument is:
    argparse checks required arguments first, and ``sdexec kill TERM -x``
    said only "the following arguments are required: PID|LABEL"."""
    required = _required_positionals(parser, command)
    for action in required:
        action.required = False  # checked below, after the unknown words
    options, unknown = parser.parse_known_args(argv)
    if unknown:
        said = f"unrecognized arguments: {_words_shown(unknown)}"
        if any(word.partition("=")[0] == "--socket" for word in unknown):
            said += " (--socket goes before the command)"
        _usage_error(command, said)
    missing = [_named(a) for a in required if getattr(options, a.dest) is None]
    if missing:
        _usage_error(
            command, f"the following arguments are required: {', '.join(missing)}"
        )
    return options


def _required_positionals(
    parser: argparse.ArgumentParser, command: str
) -> list[argparse.Action]:
    """The arguments ``command``'s parser (within ``parser``) requires
    that are not options, each taking one word or more."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            actions = action.choices[command]._actions
            return [a for a in actions if a.required and not a.option_strings]
    return []


def _named(argument: argparse.Action) -> str:
    """An argument as argparse names it: its metavar (one word here)."""
    return str(argument.metavar or argument.dest)


#: ``run``'s options that take a value, spelled out: the word after one
#: is its value, never CMD, and :func:`_parse_run` does not try it (one
#: missing here costs a parse more, no more).
_RUN_VALUED = frozenset({"--setopt", "--label", "--jobid", "--time-limit", "--dir"})
_DIGITS_AND_DOT = frozenset("0123456789.")


def _parse_run(
    parser: argparse.ArgumentParser, argv: list[str], at: int
) -> argparse.Namespace:
    """``argv``, a ``run`` whose word is ``argv[at]``, parsed with CMD's
    own arguments left as they are.

    argparse reads every word of a command line as an option or not before
    it parses any, CMD's arguments too, and a word that abbreviates two
    options is an error there: ``sdexec run ls --no`` was "ambiguous
    option: --no could match --noinput, --no-passthrough" (and ``--=x``
    abbreviates all three of the top level's), exit 2, where the early exec
    (:mod:`sdexec.earlyexec`) ran it. So the parser is given the words up
    to CMD only: up to each word after ``at`` that is not an option, in
    turn, until those words leave a command line (the word was CMD or
    after it, not an option's value); the words after are CMD's arguments.
    A command line where none does is parsed whole, as before."""
    for end in range(at + 1, len(argv)):
        if argv[end].startswith("-") or argv[end - 1] in _RUN_VALUED:
            continue  # an option, or perhaps one's value
        options = _parse_command(parser, _negative_values(argv[: end + 1]), "run")
        if options.cmdline:  # REMAINDER took the words from CMD to `end`
            options.cmdline.extend(argv[end + 1 :])
            return options
    return _parse_command(parser, _negative_values(argv), "run")


def _negative_values(words: list[str]) -> list[str]:
    """``words`` (run's options, before CMD) with a value of
    :data:`_RUN_VALUED`'s that starts with a dash and a digit or a dot
    (``--time-limit -5s``) joined to its option (``--time-limit=-5s``):
    argparse took it for an option, as it takes any such word but a plain
    number, and said "expected one argument", where the value's own check
    names what is wrong with it."""
    joined: list[str] = []
    for word in words:
        if (
            joined
            and joined[-1] in _RUN_VALUED
            and word[:1] == "-"
            and word[1:2] in _DIGITS_AND_DOT
        ):
            joined[-1] = f"{joined[-1]}={word}"
        else:
            joined.append(word)
    return joined


def _check_run(options: argparse.Namespace) -> None:
    if options.cmdline[:1] == ["--"]:  # `run -- CMD`: options end there
        del options.cmdline[0]
    if not options.cmdline:
        # As argparse says a required argument is missing, with run's usage.
        _usage_error("run", "the following arguments are required: CMD")
    # As argparse refuses run's other options: with run's usage, naming it.
    if options.waitable and not options.bg:
        _usage_error("run", "--waitable needs --bg")
    if options.label is not None and is_number(options.label):
        # kill, wait, attach and cancel read all digits as a pid: such a
        # label could never be used (`kill TERM 777`: "pid=777 not found").
        _usage_error(
            "run",
            f"--label {options.label}: all digits, which would be taken for a pid;"
            " give a label that is not a number",
        )


def _refuse_dashed_signal(words: Sequence[str]) -> None:
    """Refuse a SIGNUM of ``kill``'s ``words`` that starts with a dash
    (kill(1)'s ``-TERM``, ``-9``), naming it: argparse took ``-TERM`` for
    an unknown option and the pid after it for SIGNUM, and said ``"1234"
    is not a signal``. (No signal starts with one: nothing is refused
    here that the parser would take.)"""
    signum = _signal_word(words)
    if signum is None or len(signum) < 2 or not signum.startswith("-"):
        return
    problem = _signal_problem(signum)
    if _signal_problem(signum[1:]) is None:
        problem = (
            f"{json_quoted(signum)} is not a signal: give it without its dash"
            f" (sdexec kill {signum[1:]} PID|LABEL)"
        )
    _usage_error("kill", f"argument SIGNUM: {problem}")


def _signal_problem(text: str) -> str | None:
    """Why ``text`` is no signal (:func:`_signal_argument`'s words), or
    ``None``."""
    try:
        _signal_argument(text)
    except argparse.ArgumentTypeError as error:
        return str(error)
    return None


def _signal_word(words: Sequence[str]) -> str | None:
    """The word of ``kill``'s ``words`` that is its SIGNUM: the first that
    is not an option of its (``--all``, ``-h``, ``--help``, abbreviated),
    or the one after ``--``."""
    for at, word in enumerate(words):
        if word == "--":
            return words[at + 1] if at + 1 < len(words) else None
        if not (word.startswith("--") or word == "-h"):
            return word
    return None


def _usage_error(command: str, message: str) -> NoReturn:
    """``SystemExit(2)`` after ``command``'s usage and ``message``, as
    argparse refuses that command's arguments itself."""
    parser = CommandParser(
        prog=f"sdexec {command}", formatter_class=_HelpFormatter, program="sdexec"
    )
    _SUBCOMMANDS[command][1](parser)
    parser.error(message)


def named_command(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names, when it names one of ours before anything
    this scan cannot follow; else ``None``.

    Only that command's parser is then built: argparse spends about a
    millisecond of gettext lookups and formatters on each parser and
    argument, a sixth of the command line's start-up for all nine
    (docs/performance.md). What it parses is the same either way.
    """
    at = _command_index(argv)
    return None if at is None else argv[at]


def _command_index(argv: Sequence[str]) -> int | None:
    """Where in ``argv`` the command :func:`named_command` names is."""
    at = _first_word(argv)
    return at if at is not None and argv[at] in _SUBCOMMANDS else None


def _first_word(argv: Sequence[str]) -> int | None:
    """Where the first word of ``argv`` that is not ``--socket`` (with its
    value) is: the command's, unless it is an option (``--help``,
    ``--version``, ``--``: the whole parser's business)."""
    args = iter(enumerate(argv))
    for at, arg in args:
        option, equals, _value = arg.partition("=")
        if not (len(option) > 2 and "--socket".startswith(option)):
            return at
        if not equals:
            next(args, None)  # --socket PATH, or an abbreviation of it
    return None


def _without_options_end(argv: list[str]) -> list[str]:
    """``argv`` less a ``--`` that ends the top level's options before the
    command (``sdexec -- run true``, ``sdexec --socket S -- ps``): the word
    after it is the command, whatever it looks like, and the command's own
    words are read as without it. argparse (3.11) gave that ``--`` to the
    subcommands as the command's name: "invalid choice: '--'". A word
    there that is no command is a usage error naming it."""
    at = _first_word(argv)
    if at is None or argv[at] != "--":
        return argv
    if at + 1 == len(argv):
        return argv[:at]  # `sdexec --` alone: the COMMAND is missing
    command = argv[at + 1]
    if command not in _SUBCOMMANDS:
        _invalid_command(build_parser(), command)
    return [*argv[:at], *argv[at + 1 :]]


def _invalid_command(parser: argparse.ArgumentParser, word: str) -> NoReturn:
    """Refuse ``word`` as the command, as argparse does, but naming a word
    that is not UTF-8 by its bytes (:func:`_shown`)."""
    choices = ", ".join(map(repr, _SUBCOMMANDS))
    shown = repr(word) if is_utf8(word) else _shown(word)
    parser.error(f"argument COMMAND: invalid choice: {shown} (choose from {choices})")


def _words_shown(words: Sequence[str]) -> str:
    return " ".join(map(_shown, words))


def _shown(word: str) -> str:
    """``word`` as a usage error names it: as typed, or, not UTF-8, as
    its bytes (``b'\\xff'``, as :func:`_refuse_not_utf8` shows them):
    argparse showed the surrogates ``os.fsdecode`` kept them as
    (``'\\udcff'``), which name no byte typed."""
    if is_utf8(word):
        return word
    return repr(word.encode("utf-8", "surrogateescape"))


def build_parser(
    only: str | None = None, command_required: bool = True
) -> argparse.ArgumentParser:
    """The whole command line's parser, or with ``only`` that command;
    without ``command_required``, one that leaves a missing command to
    its caller (:func:`_parse_without_command`)."""
    parser = CommandParser(
        prog="sdexec",
        description="Run processes as transient systemd units.",
        formatter_class=_HelpFormatter,
    )
    add_version_option(parser)
    parser.add_argument(
        "--socket",
        metavar="PATH",
        type=_given,
        help="the service's socket (default: $SDEXEC_SOCKET, else"
        " $XDG_RUNTIME_DIR/sdexec/sdexec.sock)",
    )
    commands = parser.add_subparsers(
        dest="command", required=command_required, metavar="COMMAND"
    )
    for name, (help_, add_arguments) in _SUBCOMMANDS.items():
        if only in (None, name):
            command = commands.add_parser(
                name, help=help_, formatter_class=_HelpFormatter, program=parser.prog
            )
            add_arguments(command)
    return parser


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, sized as argparse sizes it (``$COLUMNS``, else
    the terminal, else 80; less 2) but without ``shutil``, whose import
    (with ``bz2`` and ``lzma``) would add a twentieth to every command's
    start-up: argparse makes a formatter for each argument it adds."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, width=_terminal_columns() - 2)


def _terminal_columns() -> int:
    columns = os.environ.get("COLUMNS", "")
    if is_number(columns) and int(columns) > 0:
        return int(columns)
    try:
        return os.get_terminal_size(1).columns or 80
    except OSError:
        return 80  # not a terminal


def _add_kill(kill: argparse.ArgumentParser) -> None:
    kill.add_argument(
        "signum",
        metavar="SIGNUM",
        type=_signal_argument,
        help="a signal name (TERM, SIGTERM) or number",
    )
    kill.add_argument(
        "--all",
        action="store_true",
        help="every process of its unit, not its main process only",
    )
    _add_target(kill)


def _add_target(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "target",
        metavar="PID|LABEL",
        type=kill_target,
        help="a process id, or else a label",
    )


def _add_cancel(cancel: argparse.ArgumentParser) -> None:
    cancel.add_argument(
        "target",
        metavar="PID|LABEL|JOBID",
        type=_cancel_target,
        help="all digits: a process id, else a job id; otherwise a job id,"
        " else a label",
    )


def _cancel_target(text: str) -> str:
    """``cancel``'s target, not an empty one (as :func:`kill_target`)."""
    return _target_given(text, "a pid, a job id or a label")


def _target_given(text: str, expected: str) -> str:
    """A ``PID|LABEL`` argument, refused if empty (a script's empty
    variable), which no process has: the service's "no such" named
    nothing."""
    if not text:
        raise argparse.ArgumentTypeError(f"must not be empty: {expected}")
    return text


def _add_stats(stats: argparse.ArgumentParser) -> None:
    stats.add_argument(
        "--url",
        type=_stats_url,
        help="read them from the stats endpoint instead of the socket,"
        " e.g. http://127.0.0.1:8490/stats",
    )


def _stats_url(text: str) -> str:
    """``stats --url``'s URL, refused where no request could be made of it,
    naming what is wrong: text that is not UTF-8 (shown as its bytes), an
    IPv6 address whose bracket is not closed, a port that is no number
    from 1 to 65535. The HTTP client said the codec's words, "DNS lookup
    failed" for port -1, "Connection refused" for 99999, or waited 30 s
    for a port past 2**64. (A URL of no http:// scheme it refuses itself,
    naming what to give.)"""
    from urllib.parse import urlsplit  # here: only --url needs it

    _refuse_not_utf8(_given(text))
    try:
        netloc = urlsplit(text).netloc
    except ValueError as error:  # "Invalid IPv6 URL": a bracket not closed
        raise argparse.ArgumentTypeError(f"{text}: not a URL: {error}") from None
    port = _port_text(netloc)
    # Its length first: int() refuses over 4300 digits, in words of its own.
    if port and not (is_number(port) and len(port) <= 5 and 0 < int(port) < 65536):
        raise argparse.ArgumentTypeError(
            f"{text}: port {port!r} is not a number from 1 to 65535"
        )
    return text


def _port_text(netloc: str) -> str:
    """The port of a URL's ``netloc`` as written (after its user, and after
    an IPv6 address's brackets), ``""`` for none."""
    host_port = netloc.rpartition("@")[2]
    return host_port.rpartition("]")[2].partition(":")[2]


def _no_arguments(_command: argparse.ArgumentParser) -> None:
    pass


def _add_run(run: argparse.ArgumentParser) -> None:
    # argparse writes the command line (one REMAINDER, below) as "...".
    run.usage = "%(prog)s [options] CMD [ARGS...]"
    run.add_argument(
        "-n",
        "--noinput",
        action="store_true",
        help="do not send stdin to the process (it reads EOF)",
    )
    run.add_argument(
        "--no-passthrough",
        dest="passthrough",
        action="store_false",
        help="relay stdin, stdout and stderr through the service instead of"
        " passing our own file descriptors to the process",
    )
    run.add_argument(
        "--setopt",
        metavar="KEY=VAL",
        action="append",
        default=[],
        type=_setopt,
        help="a subprocess option, e.g. SDEXEC_PROP_MemoryMax=512M (repeatable)",
    )
    run.add_argument(
        "--label",
        metavar="L",
        type=_name,
        help="a name for kill, wait, attach, cancel and ps",
    )
    run.add_argument(
        "--bg",
        action="store_true",
        help="run in the background: print the pid and exit (stdin is EOF)",
    )
    run.add_argument(
        "--waitable",
        action="store_true",
        help="with --bg: keep the exit status and output for sdexec wait",
    )
    run.add_argument(
        "--jobid",
        metavar="ID",
        type=_job_id,
        help="run it as job ID (SDEXEC_JOBID): sdexec cancel ID terminates it",
    )
    run.add_argument(
        "--time-limit",
        metavar="FSD",
        type=_time_limit,
        help="terminate it after this long, e.g. 30s, 5m (SDEXEC_TIME_LIMIT)",
    )
    run.add_argument(
        "--usage",
        action="store_true",
        help="print the unit's result and resource use to stderr at the end,"
        " as systemd-run --wait does",
    )
    run.add_argument(
        "--dir",
        metavar="DIR",
        type=_given,
        help="working directory (default: the current one)",
    )
    # One positional taking all the rest as it is: argparse drops a "--"
    # right after a positional of its own (`run rm -- -rf` ran `rm -rf`).
    run.add_argument(
        "cmdline",
        metavar="CMD [ARGS...]",
        nargs=argparse.REMAINDER,
        help="the command and its arguments",
    )


#: Each command: its help line, and what adds its arguments to its parser.
_SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "run": ("run a command and wait for it", _add_run),
    "ps": ("list the service's processes", _no_arguments),
    "kill": ("signal a process by pid or label", _add_kill),
    "cancel": ("terminate a job (its JOB TERMINATION sequence)", _add_cancel),
    "stats": ("print the service's statistics as JSON", _add_stats),
    "undrain": ("clear what drained the service, but what lifts itself", _no_arguments),
    "reload": (
        "reload the service's configuration file; fails with why if refused",
        _no_arguments,
    ),
    "wait": ("wait for a process started with run --bg --waitable", _add_target),
    "attach": ("follow a background process's output (Ctrl-C detaches)", _add_target),
}


def _given(text: str) -> str:
    """An option's value, refused if empty: a script's empty variable
    (``--socket "$SOCK"``) was taken for the option left out, and the
    command went to the default socket, read the socket's stats for
    ``--url``'s, or ran a plain process for ``--jobid``'s job that
    ``cancel`` could not reach. ``$SDEXEC_SOCKET`` empty still means
    unset, as environment variables conventionally do."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty (leave the option out)")
    return text


def _name(text: str) -> str:
    """A name the service keeps and repeats in every ``ps`` and stats
    answer (``--label``, ``--jobid``): given, and no longer than it takes
    one (:func:`sdexec.limits.check_lengths`), which it would otherwise
    refuse naming ``cmd.label`` or ``SDEXEC_JOBID``, never typed here."""
    from sdexec.limits import MAX_NAME  # here: at the top, every command pays

    size = len(_given(text).encode(errors="surrogateescape"))
    if size > MAX_NAME:
        raise argparse.ArgumentTypeError(f"{size} bytes; at most {MAX_NAME}")
    return text


def _job_id(text: str) -> str:
    """``--jobid``'s ID, refused where the service refuses it as
    ``SDEXEC_JOBID`` (:mod:`sdexec.plan`): a :func:`_name` of printable
    text, since it names the job in drain reasons and the log. (Text that
    is not UTF-8 :func:`sdexec.runrequest.build_command` refuses, showing
    its bytes.)"""
    from sdexec.limits import job_id_problem  # here: as in _name

    problem = job_id_problem(_name(text)) if is_utf8(text) else None
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def _time_limit(text: str) -> str:
    """``--time-limit``'s FSD, refused where the service refuses it as
    ``SDEXEC_TIME_LIMIT`` (the same :func:`sdexec.fsd.parse_fsd`); sent as
    written, for the service to read. (Text that is not UTF-8 is left to
    :func:`sdexec.runrequest.build_command`, as :func:`_job_id`'s.)"""
    from sdexec.fsd import parse_fsd  # here: at the top, every command pays

    if not is_utf8(_given(text)):
        return text
    try:
        parse_fsd(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _setopt(text: str) -> tuple[str, str]:
    key, equals, value = text.partition("=")
    if not key or not equals:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VAL")
    return key, value


def _refuse_not_utf8(text: str) -> None:
    """Refuse ``text`` if it is not UTF-8, showing its bytes: argparse, and
    the words of a check, showed the surrogates ``os.fsdecode`` kept them
    as (``"\\udcff" is not a signal``), which name no byte typed."""
    if not is_utf8(text):
        shown = text.encode("utf-8", "surrogateescape")
        raise argparse.ArgumentTypeError(f"not UTF-8 text: {shown!r}")


def _signal_argument(text: str) -> int:
    _refuse_not_utf8(text)
    try:
        return parse_signal(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def kill_target(text: str) -> dict[str, Any]:
    """The ``sdexec.kill`` target for ``PID|LABEL``: all digits is a pid,
    anything else a label; not an empty one (:func:`_target_given`)."""
    _target_given(text, "a pid or a label")
    if not is_number(text):
        return {"label": text}
    pid = pid_of(text)
    if pid is None:  # argparse said "invalid kill_target value: '…'"
        shown = text if len(text) <= 24 else f"{text[:24]}… ({len(text)} digits)"
        raise argparse.ArgumentTypeError(
            f"{shown}: larger than any pid ({MAX_PID} at most)"
        )
    return {"pid": pid}
