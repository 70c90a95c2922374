"""The command line's arguments, offline: building only the parser of the
command argv names changes nothing argparse does with them."""

from __future__ import annotations

import pytest

from sdexec import cli, cliio
from sdexec.cli import main
from sdexec.cliargs import build_parser, named_command, parse_args

ARGVS = [
    ["run", "-n", "/bin/true"],
    ["--socket", "/s", "run", "--setopt", "SDEXEC_PROP_MemoryMax=1M", "cat", "-n"],
    ["--socket=/s", "run", "--label", "x", "--bg", "--waitable", "sleep", "1"],
    ["run", "--jobid", "j1", "--time-limit", "5m", "--usage", "--dir", "/", "ls"],
    ["--sock", "/s", "ps"],
    ["kill", "TERM", "42"],
    ["kill", "9", "label"],
    ["cancel", "j1"],
    ["stats", "--url", "http://127.0.0.1:8490/stats"],
    ["undrain"],
    ["wait", "42"],
    ["attach", "label"],
]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["run", "-n", "x"], "run"),
        (["--socket", "/p", "ps"], "ps"),
        (["--socket=/p", "kill", "TERM", "1"], "kill"),
        (["--sock", "ps", "run", "x"], "run"),  # the abbreviation takes a value
        (["--so=ps", "wait", "1"], "wait"),
        (["-h", "run"], None),
        (["--version"], None),
        (["--", "run"], None),
        (["bogus"], None),
        ([], None),
    ],
)
def test_the_command_named(argv, named):
    assert named_command(argv) == named


@pytest.mark.parametrize("argv", ARGVS, ids=lambda argv: " ".join(argv))
def test_one_commands_parser_parses_as_the_whole_one(argv):
    only = named_command(argv)
    assert only is not None
    assert build_parser(only).parse_args(argv) == build_parser().parse_args(argv)


@pytest.mark.parametrize(
    "argv",
    [["run", "--help"], ["kill", "--help"], ["run", "--setopt"],
     ["kill", "NOSIG", "1"], ["run", "--bogus", "x"], ["wait"]],
    ids=lambda argv: " ".join(argv),
)  # fmt: skip
def test_help_and_errors_are_the_whole_parsers(argv, capsys):
    printed = []
    for parser in (build_parser(named_command(argv)), build_parser()):
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args(argv)
        out, err = capsys.readouterr()
        printed.append((exit_.value.code, out, err))
    assert printed[0] == printed[1]
    assert printed[0][1] or printed[0][2]


class _ClosedPipe:
    """A standard output whose reader has gone (``sdexec ... | head -1``)."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_reader_that_left_ends_the_command_quietly(monkeypatch, capsys):
    # `sdexec stats | head -1` once said "unexpected error: BrokenPipeError".
    def stats(options) -> int:
        print("{}")
        return 0

    monkeypatch.setitem(cli._COMMANDS, "stats", stats)
    monkeypatch.setattr("sys.stdout", _ClosedPipe())
    assert main(["stats"]) == 141  # as a shell says a SIGPIPE'd command
    assert capsys.readouterr().err == ""


def test_waitable_without_bg_is_a_usage_error(capsys):
    # It was exit 1, as a refusal of the service; usage errors are 2.
    # With run's usage and name, as argparse refuses its other options (it
    # had the whole command line's, "sdexec: error: ...").
    assert main(["run", "--waitable", "true"]) == 2
    assert capsys.readouterr().err == (
        "usage: sdexec run [options] CMD [ARGS...]\n"
        "sdexec run: error: --waitable needs --bg\n"
    )


@pytest.mark.parametrize(
    ("argv", "cmdline"),
    [
        (["run", "rm", "--", "-rf"], ["rm", "--", "-rf"]),
        (["run", "--bg", "kill", "--", "-1234"], ["kill", "--", "-1234"]),
        (["run", "--", "rm", "--", "-rf"], ["rm", "--", "-rf"]),
        (["run", "-n", "ls", "-l", "--", "x"], ["ls", "-l", "--", "x"]),
        # Words that abbreviate two options (--noinput, --no-passthrough;
        # --help, --version, --socket) are CMD's own after it (review
        # session 44): "ambiguous option", exit 2, where the early exec ran
        # them.
        (["run", "ls", "--no"], ["ls", "--no"]),
        (["run", "--bg", "x", "--n=1"], ["x", "--n=1"]),
        (["--socket", "/s", "run", "--label", "ls", "ls", "--=x"], ["ls", "--=x"]),
        (["run", "--label", "-x y", "ls", "--no"], ["ls", "--no"]),
    ],
)
def test_the_command_line_after_cmd_is_passed_as_it_is(argv, cmdline):
    # argparse dropped a "--" right after CMD: `run rm -- -rf` ran `rm -rf`.
    assert parse_args(argv).cmdline == cmdline


def test_run_without_a_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["run", "-n"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        "usage: sdexec run [options] CMD [ARGS...]\n"
        "sdexec run: error: the following arguments are required: CMD\n"
    )


def test_what_the_service_says_is_printed_escaped(capsys, monkeypatch):
    # A drain reason quotes a job id some client chose: printed raw, its
    # escapes cleared the admin's screen, its newline forged a line.
    reason = "unkillable user processes for job f1\x1b[2J\nsdexec: all clear"
    monkeypatch.setattr(cli, "request", lambda *_: {"reason": reason})
    cli._undrain(None)
    cliio.warn(f"node is drained: {reason}")
    out, err = capsys.readouterr()
    assert "\x1b" not in out + err and out.count("\n") == 1 and err.count("\n") == 1
    assert out.endswith("job f1\\x1b[2J\\nsdexec: all clear\n")


@pytest.mark.parametrize("bg", [["--bg"], []], ids=["bg", "foreground"])
def test_an_all_digit_label_is_a_usage_error(bg, capsys):
    # kill, wait, attach and cancel take all digits for a pid: `run --bg
    # --label 777` ran a process that `kill TERM 777` ("kill pid=777 not
    # found") and `wait 777` could never reach by its label.
    assert main(["run", *bg, "--label", "777", "true"]) == 2
    assert capsys.readouterr().err.endswith(
        "sdexec run: error: --label 777: all digits, which would be taken for a pid;"
        " give a label that is not a number\n"
    )


def test_a_label_with_other_digits_is_still_a_label():
    # Not a pid to kill_target either: "١٢" (Arabic-Indic digits), "-1", "+7".
    for label in ("١٢", "-1", "+7", "7a"):
        assert parse_args(["run", "--label", label, "true"]).label == label


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--socket", "", "ps"], "--socket"),
        (["--socket=", "run", "true"], "--socket"),
        (["stats", "--url", ""], "--url"),
        (["run", "--jobid", "", "true"], "--jobid"),
        (["run", "--bg", "--time-limit=", "true"], "--time-limit"),
        (["run", "--label", "", "true"], "--label"),
        (["run", "--dir", "", "true"], "--dir"),
    ],
)
def test_an_empty_option_value_is_a_usage_error_naming_it(argv, option, capsys):
    # A script's empty variable was taken for the option left out: the
    # default socket (perhaps another service's), the socket's stats for
    # --url's, a plain process for --jobid's job (review session 40 L4).
    assert main(argv) == 2
    assert capsys.readouterr().err.endswith(
        f"error: argument {option}: must not be empty (leave the option out)\n"
    )


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["kill", "TERM", ""], "PID|LABEL: must not be empty: a pid or a label"),
        (["wait", ""], "PID|LABEL: must not be empty: a pid or a label"),
        (["attach", ""], "PID|LABEL: must not be empty: a pid or a label"),
        (
            ["cancel", ""],
            "PID|LABEL|JOBID: must not be empty: a pid, a job id or a label",
        ),
    ],
)
def test_an_empty_target_is_a_usage_error(argv, said, capsys):
    # Read as the label "", it reached the service, whose "not found" said
    # nothing of the empty variable (review session 40 L, noticed).
    assert main(argv) == 2
    assert capsys.readouterr().err.endswith(f"error: argument {said}\n")


@pytest.mark.parametrize(
    ("url", "said"),
    [
        (
            "http://127.0.0.1:99999/stats",
            "port '99999' is not a number from 1 to 65535",
        ),
        ("http://127.0.0.1:-1/stats", "port '-1' is not a number from 1 to 65535"),
        ("http://[::1]:0/stats", "port '0' is not a number from 1 to 65535"),
        ("http://h:8490x/", "port '8490x' is not a number from 1 to 65535"),
        ("http://h:" + "9" * 5000 + "/", f"port '{'9' * 5000}' is not a number"),
        ("http://[::1:8490/stats", "not a URL: Invalid IPv6 URL"),
    ],
)
def test_a_stats_url_no_request_could_use_is_a_usage_error_naming_it(url, said, capsys):
    # The HTTP client said "DNS lookup failed" for port -1, "Connection
    # refused" for 99999, and waited 30 s for one past 2**64.
    assert main(["stats", "--url", url]) == 2
    assert f"error: argument --url: {url}: {said}" in capsys.readouterr().err


def test_a_stats_url_not_utf8_is_a_usage_error_showing_its_bytes(capsys):
    # The codec's words, naming neither --url nor the byte as given.
    url = b"http://127.0.0.1:8490/st\xffats".decode("utf-8", "surrogateescape")
    assert main(["stats", "--url", url]) == 2
    assert capsys.readouterr().err.endswith(
        "error: argument --url: not UTF-8 text: b'http://127.0.0.1:8490/st\\xffats'\n"
    )


@pytest.mark.parametrize(
    "argv",
    [["kill", "\udcff", "1"], ["kill", "-\udcff", "1"], ["kill", "--", "\udcff", "x"]],
    ids=["plain", "dashed", "after-options-end"],
)
def test_a_signal_not_utf8_is_refused_showing_its_bytes(argv, capsys):
    # The surrogate os.fsdecode kept the byte as was shown: '"\udcff" is
    # not a signal', which names no byte typed.
    assert main(argv) == 2
    shown = repr(argv[-2].encode("utf-8", "surrogateescape"))
    assert capsys.readouterr().err.endswith(
        f"error: argument SIGNUM: not UTF-8 text: {shown}\n"
    )


@pytest.mark.parametrize("command", [["kill", "TERM"], ["wait"], ["attach"]])
@pytest.mark.parametrize("digits", ["2147483648", "9" * 5000])
def test_a_number_larger_than_any_pid_is_a_usage_error_naming_it(
    command, digits, capsys
):
    # argparse said "invalid kill_target value: '999…'" (all 5000 digits)
    # past int()'s 4300; below it the service was asked for the pid.
    assert main([*command, digits]) == 2
    shown = digits if len(digits) <= 24 else f"{digits[:24]}… ({len(digits)} digits)"
    assert capsys.readouterr().err.endswith(
        f"error: argument PID|LABEL: {shown}: larger than any pid"
        " (2147483647 at most)\n"
    )


def test_cancel_of_a_number_larger_than_any_pid_takes_it_for_a_job_id():
    # Past int()'s 4300 digits cancel said "unexpected error: ValueError:
    # Exceeds the limit (4300 digits) for integer string conversion".
    for digits in ("2147483648", "9" * 5000):
        assert cli.cancel_targets(digits) == ({"jobid": digits}, {"label": digits})
    assert cli.cancel_targets("0042") == ({"pid": 42}, {"jobid": "0042"})


def test_an_empty_sdexec_socket_still_means_unset(monkeypatch):
    from sdexec.rpc import resolve_socket_path

    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/7")
    monkeypatch.setenv("SDEXEC_SOCKET", "")
    assert resolve_socket_path(None) == "/run/user/7/sdexec/sdexec.sock"


# -- run's values the service would refuse, refused as usage errors ------------

#: Time limits, job ids and labels, each good or bad as the service has it.
TIME_LIMITS = [
    "5m", "0", "0.5", ".5", "5.", "100ms", "1e3", " 30s ", "2h", "7d", "5q",
    "-1", "inf", "nan", "5 m", "1.2.3", "1e400", "1" * 400, "\u0663s", "m",
]  # fmt: skip
JOB_IDS = ["f1", "ƒ1", "a b", "a\x1bb", "f1\n", "\u200b", "x" * 1024, "x" * 1025]
LABELS = ["x", "é" * 512, "é" * 513, "a\x1bb"]


def _service_refuses(option: str, value: str) -> bool:
    """Whether the service refuses ``value`` as the option ``run``'s
    ``option`` sends, by its own checks (sdexec.joblimit, sdexec.plan)."""
    from sdexec.joblimit import parse_time_limit
    from sdexec.plan import checked_request
    from sdexec.protocolbase import command_object
    from sdexec.refusal import RequestRefused

    opts = {"SDEXEC_JOBID": value} if option == "--jobid" else {}
    label = value if option == "--label" else None
    cmd = command_object(["true"], {}, opts, cwd="/", label=label)
    try:
        if option == "--time-limit":
            parse_time_limit(value)
        else:
            checked_request({"flags": 0, "cmd": cmd}, streaming=True)
    except (ValueError, RequestRefused):
        return True
    return False


def _parser_refuses(argv: list[str]) -> bool:
    try:
        parse_args(argv)
    except SystemExit as exit_:
        assert exit_.code == 2
        return True
    return False


@pytest.mark.parametrize(
    ("option", "value"),
    [
        *(("--time-limit", value) for value in TIME_LIMITS),
        *(("--jobid", value) for value in JOB_IDS),
        *(("--label", value) for value in LABELS),
    ],
    ids=lambda part: ascii(part)[1:24],  # (not a thousand x's)
)
def test_run_refuses_what_the_service_would_and_no_more(option, value, capsys):
    # The service said `SDEXEC_TIME_LIMIT: "5q" is not a valid duration`,
    # exit 1, of a field never typed (review session 42 M3-2).
    argv = ["run", f"{option}={value}", "true"]
    assert _parser_refuses(argv) == _service_refuses(option, value)
    capsys.readouterr()


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["run", "--time-limit", "5q", "true"],
            'argument --time-limit: "5q" is not a valid duration: expected a'
            " non-negative number with an optional suffix ms, s, m, h or d",
        ),
        (
            ["run", "--bg", "--jobid", "a\x1bb", "true"],
            'argument --jobid: "a\\u001bb": a job id is printable text',
        ),
        (
            ["run", "--jobid", "x" * 1025, "true"],
            "argument --jobid: 1025 bytes; at most 1024",
        ),
        (
            ["run", "--label=" + "é" * 513, "true"],
            "argument --label: 1026 bytes; at most 1024",
        ),
    ],
)
def test_a_bad_run_value_is_a_usage_error_naming_its_option(argv, said, capsys):
    # No service listens there: the value is refused before any is asked,
    # where "cannot connect" said nothing of it.
    assert main(["--socket", "/nonexistent/sdexec.sock", *argv]) == 2
    assert capsys.readouterr().err.endswith(f"sdexec run: error: {said}\n")


def test_a_good_time_limit_is_sent_as_written():
    assert parse_args(["run", "--time-limit", " 30s ", "true"]).time_limit == " 30s "


@pytest.mark.parametrize(
    ("argv", "plain"),
    [
        (["--", "run", "true"], ["run", "true"]),
        (["--socket", "/s", "--", "ps"], ["--socket", "/s", "ps"]),
        (["--socket=/s", "--", "run", "-n", "--", "rm", "--", "-f"],
         ["--socket=/s", "run", "-n", "rm", "--", "-f"]),
        (["--", "kill", "--all", "TERM", "job"], ["kill", "--all", "TERM", "job"]),
    ],
)  # fmt: skip
def test_a_double_dash_before_the_command_ends_the_top_level_s_options(argv, plain):
    # As getopt reads it: `sdexec -- run true` was "argument COMMAND: invalid
    # choice: '--'" (argparse gave the `--` to the subcommands as a name).
    assert parse_args(argv) == parse_args(plain)


@pytest.mark.parametrize("word", ["--help", "bogus", "--"])
def test_a_word_after_that_double_dash_that_is_no_command_is_named(word, capsys):
    assert main(["--", word, "run", "true"]) == 2
    assert f"error: argument COMMAND: invalid choice: {word!r} (choose from" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--nope"], "unrecognized arguments: --nope"),
        (["--socket", "/s", "-x"], "unrecognized arguments: -x"),
        (["--nope", "ps"], "unrecognized arguments: --nope"),
        ([], "the following arguments are required: COMMAND"),
        (["--socket=/s", "--"], "the following arguments are required: COMMAND"),
    ],
)
def test_an_unknown_option_before_the_command_is_named(argv, said, capsys):
    # `sdexec --nope` said "the following arguments are required: COMMAND"
    # (argparse checks those first), naming nothing that was given.
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: sdexec [-h] [--version] [--socket PATH] COMMAND")
    assert err.endswith(f"\nsdexec: error: {said}\n")


@pytest.mark.parametrize(
    ("argv", "usage", "said"),
    [
        (["kill", "TERM", "-x"], "kill [-h] [--all] SIGNUM PID|LABEL", "-x"),
        (["cancel", "-5s"], "cancel [-h] PID|LABEL|JOBID", "-5s"),
        (["wait", "--nope"], "wait [-h] PID|LABEL", "--nope"),
    ],
)
def test_an_unknown_option_is_named_before_a_missing_argument(
    argv, usage, said, capsys
):
    # argparse checks required arguments first: `sdexec kill TERM -x` said
    # "the following arguments are required: PID|LABEL", not naming -x.
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        f"usage: sdexec {usage}\nsdexec {argv[0]}: error: unrecognized"
        f" arguments: {said}\n"
    )


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["kill"], "SIGNUM, PID|LABEL"),
        (["kill", "TERM"], "PID|LABEL"),
        (["cancel"], "PID|LABEL|JOBID"),
    ],
)
def test_a_missing_argument_is_named_as_argparse_names_it(argv, said, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.endswith(f"error: the following arguments are required: {said}\n")


@pytest.mark.parametrize(
    ("argv", "usage", "said"),
    [
        (["kill", "TERM", "1", "2"], "kill [-h] [--all] SIGNUM PID|LABEL",
         "unrecognized arguments: 2"),
        (["ps", "extra"], "ps [-h]", "unrecognized arguments: extra"),
        (["--socket=/s", "undrain", "x", "y"], "undrain [-h]",
         "unrecognized arguments: x y"),
        (["stats", "--url", "http://h:1/", "x"], "stats [-h] [--url URL]",
         "unrecognized arguments: x"),
        (["run", "--nope", "true"], "run [options] CMD [ARGS...]",
         "unrecognized arguments: --nope"),
        (["ps", "--socket", "/s"], "ps [-h]",
         "unrecognized arguments: --socket /s (--socket goes before the command)"),
        (["ps", "\udcff"], "ps [-h]", "unrecognized arguments: b'\\xff'"),
        # argparse took a value with a dash and a digit for an option:
        # "expected one argument", where --time-limit=-5s named the value.
        (["run", "--time-limit", "-5s", "true"], "run [options] CMD [ARGS...]",
         'argument --time-limit: "-5s" is not a valid duration'),
        (["run", "-n", "--time-limit", "-.5h"], "run [options] CMD [ARGS...]",
         'argument --time-limit: "-.5h" is not a valid duration'),
    ],
)  # fmt: skip
def test_a_command_s_bad_argument_is_said_with_its_usage(argv, usage, said, capsys):
    # Words a command's parser left were said with the top level's usage.
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: sdexec {usage}\n")
    assert f"\nsdexec {_command(argv)}: error: {said}" in err


def _command(argv: list[str]) -> str:
    return next(word for word in argv if not word.startswith("-"))


def test_a_dashed_value_is_run_s_option_value_and_cmd_is_untouched():
    options = parse_args(["run", "--label", "-5x", "--setopt", "-1=a", "cmd", "-5s"])
    assert (options.label, options.setopt, options.cmdline) == (
        "-5x",
        [("-1", "a")],
        ["cmd", "-5s"],
    )


@pytest.mark.parametrize(
    "argv", [["\udcff"], ["--", "\udcff"], ["--socket=/s", "\udcff"]]
)
def test_a_command_not_utf8_is_named_by_its_bytes(argv, capsys):
    # Said "invalid choice: '\udcff'", a surrogate naming no byte typed.
    assert main(argv) == 2
    assert "error: argument COMMAND: invalid choice: b'\\xff' (choose from" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["kill", "-TERM", "1234"],
         '"-TERM" is not a signal: give it without its dash'
         " (sdexec kill TERM PID|LABEL)"),
        (["kill", "--all", "-9", "job"],
         '"-9" is not a signal: give it without its dash (sdexec kill 9 PID|LABEL)'),
        (["--", "kill", "--", "-HUP", "1"],
         '"-HUP" is not a signal: give it without its dash'
         " (sdexec kill HUP PID|LABEL)"),
        (["kill", "-SIGFOO", "1234"], '"-SIGFOO" is not a signal: expected a'),
    ],
)  # fmt: skip
def test_a_dashed_signal_is_refused_naming_it(argv, said, capsys):
    # kill(1)'s `-TERM`: argparse took it for an unknown option and the pid
    # for SIGNUM, and said `"1234" is not a signal`.
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: sdexec kill [-h] [--all] SIGNUM PID|LABEL\n")
    assert f"sdexec kill: error: argument SIGNUM: {said}" in err


def test_the_label_s_help_names_every_command_that_takes_one(monkeypatch, capsys):
    # It said "a name for kill and ps": wait, attach and cancel take one too.
    monkeypatch.setenv("COLUMNS", "200")  # one line each
    assert main(["run", "--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    (label,) = [line for line in lines if line.lstrip().startswith("--label")]
    for command in ("kill", "wait", "attach", "cancel", "ps"):
        assert command in label
