"""RFC 23 Flux Standard Duration parsing and formatting."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sdexec.fsd import InfiniteDurationError, format_fsd, parse_fsd


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("5s", 5.0),
        ("30m", 1800.0),
        ("2h", 7200.0),
        ("3d", 259200.0),
        ("100ms", 0.1),
        ("0.5", 0.5),
        ("0", 0.0),
        ("0s", 0.0),
        (".5m", 30.0),
        ("1e3s", 1000.0),
        (" 5s ", 5.0),
        # Decimal arithmetic: a tenth of a minute is exactly six seconds.
        ("0.1m", 6.0),
        (5, 5.0),
        (0.25, 0.25),
    ],
)
def test_parse_valid(text, seconds):
    assert parse_fsd(text) == seconds


@pytest.mark.parametrize(
    "text",
    [
        "5x",
        "-1",
        "-1s",
        "-inf",
        "nan",
        "",
        "s",
        "5 s s",
        "1,5s",
        "5S",
        "1_000",
    ],
)
def test_parse_invalid_quotes_the_text(text):
    with pytest.raises(ValueError) as error:
        parse_fsd(text)
    assert str(error.value).startswith(f'"{text}" is not a valid duration: expected')


@pytest.mark.parametrize(("text", "seconds"), [("+5s", 5.0), (" +.5m", 30.0)])
def test_a_leading_plus_is_read_as_flux_reads_it(text, seconds):
    # strtod takes the sign, so Flux's fsd_parse_duration reads "+5s" as 5 s.
    assert parse_fsd(text) == seconds


@pytest.mark.parametrize(
    "text", ["inf", "infinity", "INF", "+Infinity", "1e400", "1e999999d"]
)
def test_an_infinite_duration_is_refused_saying_flux_reads_it(text):
    # Flux's strtod reads each as infinite, a timeout that never fires.
    with pytest.raises(InfiniteDurationError) as error:
        parse_fsd(text)
    assert str(error.value).startswith(
        f'"{text}" is not a valid duration: Flux reads it as infinite (strtod),'
        " a timeout that never fires, which sdexec does not take; expected"
    )


def test_an_infinite_number_is_refused_as_infinite():
    with pytest.raises(InfiniteDurationError) as error:
        parse_fsd(math.inf)
    assert str(error.value).startswith(
        "Infinity is not a valid duration: infinite, a timeout that never fires"
    )


@pytest.mark.parametrize("text", ["0x10", "0x1p4", "0x1d", " 0X.8s"])
def test_hexadecimal_is_refused_saying_what_flux_reads(text):
    # strtod reads hexadecimal, "d" a digit: "0x1d" is 29 s to Flux, not a day.
    with pytest.raises(ValueError) as error:
        parse_fsd(text)
    assert str(error.value).startswith(
        f'"{text}" is not a valid duration: sdexec takes no hexadecimal'
        ' (Flux\'s strtod reads it: "0x1d" is 29 s there, not a day): expected'
    )


@pytest.mark.parametrize("text", ["\uff15m", "\u0661s"])
def test_digits_of_other_scripts_are_no_duration(text):
    # int() and Decimal() take them, Flux does not (review 38 R2).
    with pytest.raises(ValueError, match="is not a valid duration"):
        parse_fsd(text)


@pytest.mark.parametrize("value", [True, None, -1, -0.5, math.inf, math.nan, [5]])
def test_parse_refuses_non_durations(value):
    with pytest.raises(ValueError, match="is not a valid duration"):
        parse_fsd(value)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (5, "5s"),
        (90, "90s"),
        (1800, "30m"),
        (3600, "1h"),
        (86400, "1d"),
        (0.001, "1ms"),
        (0.5, "0.5s"),
        (1220.5, "1220.5s"),
    ],
)
def test_format_shortest(seconds, text):
    assert format_fsd(seconds) == text


def test_format_refuses_negative():
    with pytest.raises(ValueError):
        format_fsd(-1)


@given(st.floats(min_value=0, allow_nan=False, allow_infinity=False))
def test_format_parse_round_trip(seconds):
    assert parse_fsd(format_fsd(seconds)) == seconds


@given(
    st.integers(min_value=0, max_value=10**9),
    st.sampled_from([("ms", 0.001), ("s", 1), ("m", 60), ("h", 3600), ("d", 86400)]),
)
def test_parse_integer_with_unit(number, unit):
    suffix, per_unit = unit
    assert parse_fsd(f"{number}{suffix}") == pytest.approx(number * per_unit)


@given(st.text(alphabet="0123456789.eE+-smhdx ", max_size=12))
def test_parse_never_fails_otherwise_than_with_value_error(text):
    try:
        seconds = parse_fsd(text)
    except ValueError:
        return
    assert math.isfinite(seconds) and seconds >= 0
