"""Signal names and numbers as configuration writes them."""

import signal

import pytest

from sdexec.signals import parse_signal, signal_name


@pytest.mark.parametrize(
    ("value", "number"),
    [
        ("SIGTERM", signal.SIGTERM),
        ("TERM", signal.SIGTERM),
        ("term", signal.SIGTERM),
        ("SigKill", signal.SIGKILL),
        ("SIGUSR1", signal.SIGUSR1),
        ("15", 15),
        (10, 10),
        ("SIGRTMIN+2", signal.SIGRTMIN + 2),
        ("rtmax-1", signal.SIGRTMAX - 1),
        ("0009", 9),
        ("+15", 15),  # as Flux's strtol reads term-signal = "+15"
    ],
)
def test_parse_signal(value, number):
    assert parse_signal(value) == number


@pytest.mark.parametrize(
    "value",
    ["SIGFOO", "", "SIG_DFL", 0, -9, signal.NSIG, True, None, "+", "++15", "-15",
     # Not int()'s own complaints ("invalid literal", "Exceeds the limit").
     "\u00b2", "1" * 5000, "SIGRTMIN+" + "1" * 5000],
)  # fmt: skip
def test_parse_signal_refuses(value):
    with pytest.raises(ValueError, match="is not a signal: expected a signal name"):
        parse_signal(value)


def test_signal_name():
    assert signal_name(signal.SIGTERM) == "SIGTERM"
    assert signal_name(signal.SIGKILL) == "SIGKILL"
    assert signal_name(signal.SIGRTMIN + 3) == "SIGRTMIN+3"


@pytest.mark.parametrize("number", range(1, signal.NSIG))
def test_name_parses_back(number):
    assert parse_signal(signal_name(number)) == number


def test_names_are_the_signal_enum_s():
    # Read from the C core without the enum (its import is 2.5 ms of
    # `sdexec run`'s start): each number still gets the enum's name (SIGABRT,
    # not its alias SIGIOT), and each name the enum knows, alias or not,
    # its number.
    for number in range(1, signal.NSIG):
        if number in signal.Signals._value2member_map_:
            assert signal_name(number) == signal.Signals(number).name
    for name, member in signal.Signals.__members__.items():
        assert parse_signal(name) == member.value
