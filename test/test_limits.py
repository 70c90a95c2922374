"""sdexec.limits: text, exec and message-size checks (issue 16)."""

from __future__ import annotations

import errno
import json

import pytest
from hypothesis import HealthCheck, given, settings
from strategies import any_text, commands

from sdexec.limits import (
    KERNEL_ARG_CEILING,
    MAX_ARG_STRLEN,
    MAX_COMMAND,
    MAX_LISTED_CMDLINE,
    MAX_LISTED_NAME,
    MAX_NAME,
    MAX_START_MESSAGE,
    PATH_MAX,
    SYSTEMD_ENV_RESERVE,
    arg_max,
    check_command_size,
    check_exec_size,
    check_lengths,
    check_start_message,
    check_text,
    check_texts,
    check_unit_file_lines,
    command_line_length,
    command_text,
    environment_line_length,
    listed_cmdline,
    listed_name,
)
from sdexec.refusal import RequestRefused
from sdexec.unitfile import LONG_LINE_MAX, MAX_UNIT_LINE, UnitFileEscapes

POINTER = 8


def check_command(*args) -> None:
    check_texts(command_text(*args))


def refused(call, *args, **kwargs) -> RequestRefused:
    with pytest.raises(RequestRefused) as caught:
        call(*args, **kwargs)
    json.dumps(caught.value.errstr).encode("utf-8")  # always sendable
    return caught.value


@pytest.mark.parametrize(
    ("value", "why"),
    [("a\ud800b", "lone surrogate U+D800 at 1"), ("ab\0", "NUL character at 2")],
)
def test_text_names_the_field_and_the_problem(value: str, why: str) -> None:
    error = refused(check_text, "topic", value)
    assert error.errnum == errno.EINVAL
    assert error.errstr.startswith("topic: ") and why in error.errstr


@pytest.mark.parametrize(
    ("command", "field"),
    [
        ({"cmdline": ["a", "b", "\ud800"]}, "cmd.cmdline[2]: "),
        ({"cmdline": ["a"], "env": {"FOO": "x\0"}}, "cmd.env.FOO: "),
        ({"cmdline": ["a"], "env": {"F\udc80": "x"}}, "cmd.env (key 'F\\udc80'): "),
        ({"cmdline": ["a"], "opts": {"SDEXEC_NAME": "\ud800"}}, "cmd.opts.SDEXEC_NAME"),
        ({"cmdline": ["a"], "label": "\udfff"}, "cmd.label: "),
        ({"cmdline": ["a"], "cwd": "/\0"}, "cmd.cwd: "),
    ],
)
def test_command_text_names_the_field(command: dict, field: str) -> None:
    error = refused(
        check_command,
        command["cmdline"],
        command.get("env", {}),
        command.get("opts", {}),
        command.get("cwd"),
        command.get("label"),
    )
    assert error.errnum == errno.EINVAL
    assert error.errstr.startswith(field), error.errstr


def is_clean(text: str) -> bool:
    return "\0" not in text and not any(0xD800 <= ord(c) <= 0xDFFF for c in text)


@settings(derandomize=True, max_examples=300, deadline=None)
@given(commands(any_text))
def test_command_text_refuses_exactly_the_bad_strings(command: dict) -> None:
    strings = [*command["cmdline"], command.get("cwd", ""), command.get("label", "")]
    for mapping in (command["env"], command["opts"]):
        strings += [*mapping, *mapping.values()]
    args = (
        command["cmdline"],
        command["env"],
        command["opts"],
        command.get("cwd"),
        command.get("label"),
    )
    if all(is_clean(s) for s in strings):
        check_command(*args)
    else:
        assert refused(check_command, *args).errnum == errno.EINVAL


def test_max_arg_strlen_is_linux_value_on_4k_pages() -> None:
    assert MAX_ARG_STRLEN >= 131072


def test_an_argument_of_max_arg_strlen_minus_one_bytes_is_accepted() -> None:
    check_exec_size("/bin/true", ["true", "x" * (MAX_ARG_STRLEN - 1)], {})


def test_one_byte_more_is_e2big_naming_the_argument() -> None:
    error = refused(
        check_exec_size, "/bin/true", ["true", "é" * (MAX_ARG_STRLEN // 2)], {}
    )
    assert error.errnum == errno.E2BIG
    assert error.errstr.startswith(f"cmd.cmdline[1]: {MAX_ARG_STRLEN} bytes")


def test_an_environment_string_counts_name_and_equals() -> None:
    value = "x" * (MAX_ARG_STRLEN - 1 - len("FOO="))
    check_exec_size("/bin/true", ["true"], {"FOO": value})
    error = refused(check_exec_size, "/bin/true", ["true"], {"FOO": value + "x"})
    assert error.errnum == errno.E2BIG and error.errstr.startswith("cmd.env.FOO: ")


def test_total_counted_as_the_kernel_does() -> None:
    args = ["a" * 99, "b" * 99]
    env = {"K": "v" * 98}  # "K=" + 98 = 100 bytes
    exact = SYSTEMD_ENV_RESERVE + 3 * POINTER + len("/x") + 1 + 100 + 100 + 101
    check_exec_size("/x", args, env, limit=exact)
    error = refused(check_exec_size, "/x", args, env, limit=exact - 1)
    assert error.errnum == errno.E2BIG
    assert "2 arguments and 1 environment variables" in error.errstr
    assert "(ARG_MAX)" in error.errstr


def test_issue_16_reproductions_are_refused_before_systemd() -> None:
    for cmdline in (
        ["true", "x" * 10_000_000],
        ["true", *["y" * 60_000] * 100],
        ["true", *["z" * 10_000] * 1000],
    ):
        assert refused(check_exec_size, "/bin/true", cmdline, {}).errnum == errno.E2BIG


def test_arg_max_is_clamped_to_the_kernel_range() -> None:
    assert arg_max(2**62) == KERNEL_ARG_CEILING
    assert arg_max(4096) == 128 * 1024
    assert arg_max(2 * 1024 * 1024) == 2 * 1024 * 1024
    assert 128 * 1024 <= arg_max() <= KERNEL_ARG_CEILING


def test_start_message_cap() -> None:
    small = check_start_message(
        "a.service", "/bin/true", ["true"], {"PATH": "/bin"}, {}
    )
    assert len("a.service/bin/truetruePATH=/bin") < small < 4096
    # A megabyte environment fits the message (what limits it is its line
    # of the unit's file: check_unit_file_lines).
    check_start_message(
        "a.service", "/bin/true", ["true"], {"BIG": "x" * 1024 * 1024}, {}
    )
    error = refused(
        check_start_message,
        "a.service",
        "/bin/true",
        ["true"],
        {},
        {"Description": "d" * MAX_START_MESSAGE},
    )
    assert error.errnum == errno.E2BIG and "StartTransientUnit" in error.errstr


#: A string with every kind of character systemd 252 writes differently in
#: a command and in an environment, and the two lines it wrote into the
#: transient unit's file for it (measured with a private ``systemd --user``:
#: ``ExecStart`` of ``/opt/my $dir%/run;me``, the arguments ``run``,
#: ``TRICKY`` and ``""``; ``Environment`` of ``S=TRICKY`` and ``EMPTY=``).
#: sdexec itself sends no ``$`` or ``;`` in ``ExecStart``
#: (sdexec/execstart.py); the count holds for them all the same.
TRICKY = "a b$c%d\"e'f\\g;h\x01i\tj\x7fk\u00e9l\u2028m\U0001f600n\x1bo`p!q*r\\\\"
WRITTEN_COMMAND = (
    b'ExecStart=@/opt/my \\$dir%%/run\\;me "run" "a b\\$c%%d\\"e\\\'f\\\\g\\;h'
    b'\\001i\\tj\\177k\xc3\xa9l\xe2\x80\xa8m\xf0\x9f\x98\x80n\\033o`p!q*r\\\\\\\\" ""'
)
WRITTEN_ENVIRONMENT = (
    b'Environment="S=a b$c%%d\\"e\\\'f\\\\g;h\\001i\\tj\\177k\\303\\251l\\342\\200'
    b'\\250m\\360\\237\\230\\200n\\033o`p!q*r\\\\\\\\" "EMPTY="'
)


def test_a_unit_file_line_is_counted_as_systemd_252_writes_it() -> None:
    cmdline = ["run", TRICKY, ""]
    assert command_line_length("/opt/my $dir%/run;me", cmdline) == len(WRITTEN_COMMAND)
    env = {"S": TRICKY, "EMPTY": ""}
    assert environment_line_length(env) == len(WRITTEN_ENVIRONMENT)
    # An executable that is its first argument is not written twice:
    # ExecStart="/bin/sh" "-c" "sleep 30" "a b\$c%%d…" "%%h \$HOME\; é".
    cmdline = ["/bin/sh", "-c", "sleep 30", TRICKY, "%h $HOME; é"]
    assert command_line_length("/bin/sh", cmdline) == 117


def line_refusal(field: str, length: int) -> str:
    return (
        f"{field}: {length} bytes as systemd writes it into the unit's file, more"
        f" than the {MAX_UNIT_LINE} sdexec allows: systemd reads back no line of"
        f" {LONG_LINE_MAX} bytes or more (LONG_LINE_MAX), and the unit would lose"
        " every property at the next daemon-reload"
    )


@pytest.mark.parametrize(
    ("cmdline", "env", "refusal"),
    [
        # Review 42 H-1's four: each was started, and its unit failed to
        # load at the next daemon-reload, losing the site's limits.
        (
            ["true"],
            {f"E{k:02d}": "e" * 120_000 for k in range(12)},
            line_refusal("cmd.env", 12 + 12 * (3 + 1 + 120_000 + 2) + 11),
        ),
        (
            ["true", *["a" * 120_000] * 12],
            {},
            line_refusal("cmd.cmdline", 11 + 9 + (3 + 4) + 12 * (120_000 + 3)),
        ),
        (
            ["true"],
            {f"N{k}": "n" * 120_000 for k in range(9)},
            line_refusal("cmd.env", 12 + 9 * (2 + 1 + 120_000 + 2) + 8),
        ),
        # 300 KB, each control character written as four bytes (\001).
        (
            ["true"],
            {f"C{k}": "\x01" * 100_000 for k in range(3)},
            line_refusal("cmd.env", 12 + 3 * (2 + 1 + 400_000 + 2) + 2),
        ),
    ],
    ids=["1.44MB-env", "1.44MB-cmdline", "1.08MB-env", "300KB-controls-env"],
)
def test_a_line_systemd_could_not_read_back_is_e2big(cmdline, env, refusal) -> None:
    error = refused(check_unit_file_lines, "/bin/true", cmdline, env)
    assert (error.errnum, error.errstr) == (errno.E2BIG, refusal)


def test_a_line_of_exactly_the_limit_is_taken_one_byte_more_is_e2big() -> None:
    value = "x" * (MAX_UNIT_LINE - len('Environment="A="'))
    assert environment_line_length({"A": value}) == MAX_UNIT_LINE
    check_unit_file_lines("/bin/true", ["true"], {"A": value})
    error = refused(check_unit_file_lines, "/bin/true", ["true"], {"A": value + "%"})
    assert error.errstr == line_refusal("cmd.env", MAX_UNIT_LINE + 2)


def test_a_large_plain_environment_is_taken_without_escaping_an_ordinary_one(
    monkeypatch,
) -> None:
    large = {f"VAR{k:04d}": "v" * 900 for k in range(1000)}  # 908 KB
    check_unit_file_lines("/bin/true", ["true"], large)

    def escaped(_escapes, _text):
        raise AssertionError("an ordinary command was escaped")

    # Each exec is checked: one that cannot come near the limit, even with
    # each byte escaped to four, is only measured.
    monkeypatch.setattr(UnitFileEscapes, "length", escaped)
    ordinary = {f"VAR{k:03d}": "\x01" * 1000 for k in range(200)}
    check_unit_file_lines("/bin/true", ["true", "é" * 50_000], ordinary)


#: What a marshalled string adds to its bytes, as the budget counts it.
FRAMING = 8


def test_every_string_of_a_command_counts_once_with_its_framing() -> None:
    size = check_command_size(["ab", "c"], {"E": "vv"}, {"O": "w"}, "/d", "l")
    strings = ["ab", "c", "E", "vv", "O", "w", "/d", "l"]
    assert size == sum(len(text) + FRAMING for text in strings)
    assert check_command_size(["é"], {}, {}) == 2 + FRAMING  # bytes, not characters


def test_a_command_of_exactly_the_budget_is_taken_one_byte_more_is_e2big() -> None:
    value = "x" * (MAX_COMMAND - len("/bin/true") - len("K") - 3 * FRAMING)
    assert check_command_size(["/bin/true"], {}, {"K": value}) == MAX_COMMAND
    error = refused(check_command_size, ["/bin/true"], {}, {"K": value + "x"})
    assert error.errnum == errno.E2BIG
    assert error.errstr.startswith(
        f"cmd: its strings take {MAX_COMMAND + 1} bytes, more than the {MAX_COMMAND}"
    )
    assert f"the largest cmd.opts.K ({MAX_COMMAND - 16} bytes)" in error.errstr


def test_the_refusal_names_the_part_that_takes_the_most() -> None:
    many = {f"A{k}": "" for k in range(MAX_COMMAND // 16)}  # 2 strings each
    error = refused(
        check_command_size, ["/bin/true", "y" * 100_000], many, {"O": "z" * 200_000}
    )
    assert "the most of them in cmd.env: " in error.errstr
    assert f"in {len(many)} entries, the largest cmd.env.A" in error.errstr
    error = refused(check_command_size, ["a"] * (MAX_COMMAND // 9 + 1), {}, {})
    assert "the largest cmd.cmdline[0] (9 bytes)" in error.errstr


def test_a_long_name_is_cut_in_the_refusal() -> None:
    name = "N" * 100_000
    error = refused(check_command_size, ["a"], {name: "v" * MAX_COMMAND}, {})
    assert f"cmd.env.{'N' * 64}… (" in error.errstr
    assert len(error.errstr) < 400


def test_the_working_directory_counts_in_the_start_message() -> None:
    args = ("a.service", "/bin/true", ["true"], {}, {})
    without = check_start_message(*args)
    assert check_start_message(*args, "/" + "d" * 4000) > without + 4000


def test_a_cwd_is_a_path_shorter_than_path_max() -> None:
    check_lengths("/" + "d" * (PATH_MAX - 2), {})
    error = refused(check_lengths, "/" + "d" * (PATH_MAX - 1), {})
    assert error.errnum == errno.ENAMETOOLONG
    assert error.errstr == "cmd.cwd: 4096 bytes; a path is shorter than 4096 (PATH_MAX)"


def test_a_label_or_job_id_is_a_name_not_a_payload() -> None:
    check_lengths(None, {"cmd.label": "é" * (MAX_NAME // 2), "SDEXEC_JOBID": None})
    error = refused(check_lengths, None, {"cmd.label": "l", "SDEXEC_JOBID": "j" * 1025})
    assert error.errnum == errno.EINVAL
    assert error.errstr == "SDEXEC_JOBID: 1025 bytes; at most 1024"


def test_a_listed_command_line_is_whole_up_to_its_limit_then_cut() -> None:
    short = ["sh", "-c", "x" * (MAX_LISTED_CMDLINE - 4)]
    assert listed_cmdline(short) == short
    long = ["sh", "-c", "x" * MAX_ARG_STRLEN, "never shown"]
    assert listed_cmdline(long) == ["sh", "-c", "x" * (MAX_LISTED_CMDLINE - 4) + "…"]
    assert listed_cmdline(["a"] * 5000)[-1] == "…"
    assert len(listed_cmdline(["a"] * 5000)) == MAX_LISTED_CMDLINE + 1
    empties = listed_cmdline([""] * 200_000)  # each counts as a character
    assert (len(empties), empties[-1]) == (MAX_LISTED_CMDLINE + 1, "…")


@settings(
    derandomize=True,
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(commands())
def test_checks_only_ever_refuse_with_request_refused(command: dict) -> None:
    try:
        check_command(command["cmdline"], command["env"], command["opts"])
        check_exec_size("/bin/x", command["cmdline"], command["env"])
        check_command_size(command["cmdline"], command["env"], command["opts"])
        check_start_message(
            "u.service", "/bin/x", command["cmdline"], command["env"], command["opts"]
        )
    except RequestRefused as error:
        assert error.errnum in (errno.EINVAL, errno.E2BIG)


def test_a_listed_name_is_upstream_s_cmd() -> None:
    assert listed_name(["/bin/sleep", "30"]) == "/bin/sleep"
    assert listed_name(["flux", "module-exec", "x"]) == "flux module-exec"
    assert listed_name(["flux"]) == "flux"
    assert listed_name([]) == ""
    assert listed_name(["flux", "x" * 100]) == ("flux " + "x" * 100)[:MAX_LISTED_NAME]


def test_a_listed_name_keeps_a_long_path_whole() -> None:
    # Upstream's 64-byte buffer holds only "flux SUBCOMMAND": any other
    # program is listed whole, and cut at 63 a long path lost its last
    # part, the program's name.
    path = "/p/lustre1/someone/projects/a-long-project-name/build/bin/simulate"
    assert len(path) > MAX_LISTED_NAME
    assert listed_name([path, "-x"]) == path
    assert listed_name(["x" * 5000]) == "x" * MAX_LISTED_CMDLINE + "…"
