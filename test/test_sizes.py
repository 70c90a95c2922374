"""Memory sizes and limits as systemd writes them."""

from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sdexec.sizes import (
    MemoryLimit,
    SizeNotTaken,
    SizeTooLarge,
    octal_differs,
    parse_flux_percent,
    parse_flux_size,
    parse_permyriad,
    parse_size,
    scale_from_permyriad,
)

SUFFIXES = {
    "": 1,
    "K": 1024,
    "M": 1024**2,
    "G": 1024**3,
    "T": 1024**4,
    "P": 1024**5,
    "E": 1024**6,
}
# Two decimals at most, as systemd keeps a percentage.
PERCENTS = st.decimals(min_value=0, max_value=100, places=2)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("0", 0),
        ("4096", 4096),
        ("512M", 512 * 1024**2),
        ("1.5G", 3 * 1024**3 // 2),
        ("2T", 2 * 1024**4),
        (" 64 M ", 64 * 1024**2),
        ("4g", 4 * 1024**3),  # either case, as Flux's mapper
        ("1k", 1024),
        ("3p", 3 * 1024**5),
        ("15E", 15 * 1024**6),
        ("18446744073709551615", 2**64 - 1),
    ],
)
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize(
    "text",
    # Digits of other scripts, which int() takes and systemd does not
    # (review 38 H2-3): the integers of sdexec.property refuse them too.
    ["", "-1", "5X", "5MB", "1.5.5G", "G", "1e3", "5z", "\uff11G", "\u0661G"],
)
def test_parse_size_refuses(text):
    with pytest.raises(ValueError, match="is not a size"):
        parse_size(text)


@pytest.mark.parametrize("text", ["16E", "16384P", "18446744073709551616"])
def test_sizes_beyond_64_bits_are_refused(text):
    with pytest.raises(ValueError, match="is not a size systemd can hold"):
        parse_size(text)


# systemd keeps sizes in 64 bits; every such size must come back exact.
UINT64_MAX = 2**64 - 1


@given(st.sampled_from(sorted(SUFFIXES)), st.data())
def test_size_with_suffix_round_trip(suffix, data):
    number = data.draw(st.integers(0, UINT64_MAX // SUFFIXES[suffix]))
    assert parse_size(f"{number}{suffix}") == number * SUFFIXES[suffix]
    assert parse_size(f"{number}{suffix.lower()}") == number * SUFFIXES[suffix]


@given(st.integers(min_value=0, max_value=UINT64_MAX))
def test_bytes_limit_round_trip(size):
    limit = MemoryLimit.parse(str(size))
    assert limit == MemoryLimit(bytes=size)
    assert MemoryLimit.parse(str(limit)) == limit


@given(PERCENTS)
def test_percent_limit_round_trip(percent):
    limit = MemoryLimit.parse(f"{percent:f}%")
    assert limit.percent == float(percent)
    assert MemoryLimit.parse(str(limit)) == limit


@given(st.decimals(min_value=Decimal("100.01"), max_value=10**6, places=2))
def test_percent_over_100_refused(percent):
    with pytest.raises(ValueError, match="more than 100%"):
        MemoryLimit.parse(f"{percent:f}%")


def test_infinity():
    limit = MemoryLimit.parse("infinity")
    assert limit.infinite
    assert str(limit) == "infinity"
    assert not MemoryLimit.parse("1G").infinite
    assert not MemoryLimit.parse("0%").infinite


@pytest.mark.parametrize("text", ["lots", "-5%", "95 %", "Infinity", "", "\uff15%"])
def test_memory_limit_refuses(text):
    with pytest.raises(ValueError, match="is not a size"):
        MemoryLimit.parse(text)


@pytest.mark.parametrize(
    "text", ["9" * 21, "1" + "0" * 20 + "K", "9" * 999_000, "9" * 999_990 + "E"]
)
def test_a_number_of_more_than_20_digits_is_refused_before_any_arithmetic(text):
    # A million digits once cost ~22 s of Decimal-to-int conversion, and
    # past the Decimal context's exponent an Overflow escaped the request.
    with pytest.raises(ValueError, match="16E or more"):
        parse_size(text)


def test_leading_zeros_are_not_digits_too_many():
    assert parse_size("0" * 100_000 + "1G") == 2**30


def test_more_than_20_decimals_are_refused():
    assert parse_size("1." + "5" * 20 + "G") == 1670265060
    with pytest.raises(ValueError, match="more than 20 decimals"):
        parse_size("1." + "5" * 21)


@pytest.mark.parametrize(
    ("text", "permyriad"),
    [("0%", 0), ("0.01%", 1), ("3.13%", 313), ("12.5%", 1250), ("100%", 10_000),
     ("100.00%", 10_000), ("007%", 700)],
)  # fmt: skip
def test_a_percentage_is_ten_thousandths(text, permyriad):
    assert parse_permyriad(text) == permyriad
    assert MemoryLimit.parse(text).permyriad == permyriad


@pytest.mark.parametrize("text", ["3.125%", "0.004%", "0.00000001%", "50.001%"])
def test_a_percentage_of_more_than_two_decimals_is_refused(text):
    # systemd keeps ten-thousandths, and writes the rounded one into the
    # unit's file: 0.004% came back as 0.00%, no limit, at a daemon-reload
    # (review 43 T5-1).
    with pytest.raises(SizeNotTaken, match="more than two decimals"):
        MemoryLimit.parse(text)


@pytest.mark.parametrize("text", ["1000%", "9" * 100_000 + "%"])
def test_a_percentage_past_100_is_refused_at_any_length(text):
    with pytest.raises(SizeNotTaken, match="more than 100%"):
        parse_permyriad(text)


@pytest.mark.parametrize(
    ("text", "refusal"),
    [("1e999999999999999999999%", "more than 100%"),
     ("-1e999999999999999999999%", "not a size"),
     ("-1e1000000%", "not a size"),
     ("1e-999999999999999999999%", "more than two decimals"),
     ("1" * 100_000 + "e-9999999999999999999999%", "more than two decimals")],
    ids=["past-100", "negative", "negative-past-emax", "below-0.01", "long-below-0.01"],
)  # fmt: skip
def test_a_percentage_with_an_exponent_past_decimal_s_is_judged(text, refusal):
    # Decimal cannot hold an exponent of 19 digits: its InvalidOperation
    # reached the client as an internal error (EOTHER), with a traceback.
    with pytest.raises(ValueError, match=refusal):
        MemoryLimit.parse(text)


@pytest.mark.parametrize(
    "text", ["0e99999999999999999999999%", "-0.0e-99999999999999999999%"]
)
def test_zero_with_an_exponent_past_decimal_s_is_0_percent(text):
    assert MemoryLimit.parse(text).permyriad == 0


@given(
    st.from_regex(r"[+-]?[0-9]{0,3}\.?[0-9]{0,3}", fullmatch=True),
    st.integers(-(10**30), 10**30),
)
def test_a_percentage_at_any_exponent_is_taken_or_refused_so(digits, exponent):
    try:
        limit = MemoryLimit.parse(f"{digits}e{exponent}%")
    except ValueError:
        return  # refused, as a ValueError says (EINVAL), not an internal error
    assert limit.permyriad is not None and 0 <= limit.permyriad <= 10_000


@pytest.mark.parametrize(
    ("permyriad", "scale"),
    [(0, 0), (1, 429497), (5000, 2**31), (3000, 1288490189), (10_000, 2**32 - 1)],
)
def test_scale_from_permyriad_is_systemd_s(permyriad, scale):
    """UINT32_SCALE_FROM_PERMYRIAD: (p * UINT32_MAX + 5000) / 10000."""
    assert scale_from_permyriad(permyriad) == scale
    assert MemoryLimit(permyriad=permyriad).scale == scale


@pytest.mark.parametrize(("text", "size"), [("512B", 512), ("1b", 1), ("1.5KB", None)])
def test_a_size_in_bytes_may_say_b(text, size):
    # systemd's parse_size takes B (review 43 T5-6); a B after another
    # suffix it does not.
    if size is None:
        with pytest.raises(ValueError, match="is not a size"):
            parse_size(text)
    else:
        assert parse_size(text) == size
        assert MemoryLimit.parse(text) == MemoryLimit(bytes=size)


@pytest.mark.parametrize("text", ["1G 512M", "1 2"])
def test_a_sum_of_sizes_is_refused_saying_so(text):
    with pytest.raises(SizeNotTaken, match="does not take a sum of sizes"):
        MemoryLimit.parse(text)


def test_what_is_not_a_size_is_told_every_suffix_including_b():
    # The message listed K to E only once B was taken too (review session
    # 43 R, left over).
    with pytest.raises(ValueError, match="alone or with B, K, M, G, T, P or E"):
        parse_size("5X")


def test_what_is_not_a_memory_limit_is_told_every_form():
    with pytest.raises(ValueError) as error:
        MemoryLimit.parse("5X")
    assert str(error.value) == (
        "'5X' is not a size (a number (decimal, 0x hex, 0 octal or floating"
        " point), alone or with k, K, M, G, T, P or E), a percentage up to 100%"
        " (two decimals at most) or 'infinity'"
    )


# Flux's own table (flux-core src/common/libutil/test/parse_size.c), then
# what strtoull and strtold read besides: a request's <stream>_BUFSIZE is
# read as Flux's servers read it. None: refused.
FLUX_SIZES = [
    # upstream's bad ones
    ("xx", None),
    ("", None),
    ("1q", None),
    ("1kb", None),
    ("-1", None),
    ("1E20", None),  # EOVERFLOW
    ("M", None),
    ("1m", None),
    ("1g", None),
    ("nan", None),
    ("inf", None),
    ("1b", None),
    # upstream's good ones
    ("0", 0),
    ("0K", 0),
    ("077", 63),
    ("0xff", 255),
    ("+42", 42),
    ("1", 1),
    ("1E2", 100),
    ("4k", 4096),
    ("1M", 1048576),
    ("2G", 2147483648),
    ("0.5k", 512),
    ("4T", 4398046511104),
    ("18446744073709551615", 2**64 - 1),
    ("  42", 42),
    ("1P", 1125899906842624),
    ("0.5E", 576460752303423488),
    # strtoull, base 0: hex and octal take a suffix; "08" is not octal, so
    # strtold reads it; a hex "E" is a digit, not exa.
    ("0x1000", 4096),
    ("0X10k", 16384),
    ("010K", 8192),
    ("08", 8),
    ("0x1E", 30),
    ("0x", None),
    # strtold: exponents, points, hex floats, rounded down.
    ("1e3", 1000),
    ("1.5", 1),
    (".5k", 512),
    ("5.k", 5120),
    ("0x1p4", 16),
    ("0x.8k", 512),
    ("1e-3", 0),
    ("1E", 1024**6),  # an "E" with no exponent is the suffix
    ("1E+", None),
    ("infinity", None),
    ("-0", 0),  # as strtold reads it: not below zero
    ("-0.5k", None),
    # white space before, as strtoull and strtold skip it; not after.
    ("\t\n42k", 43008),
    ("42 ", None),
    ("4 k", None),
    ("1G 512M", None),
    # what Python reads but C does not
    ("1_000", None),
    ("\uff14\uff12", None),
    ("42\x00", None),
    # past 64 bits: 16E and a product Flux lets wrap, a number strtoull
    # overflows (strtold reads it as 2**64), a float past a double.
    ("16E", None),
    ("17E", None),
    ("18446744073709551616", None),
    ("0x10000000000000000", None),
    ("1e400", None),
    ("16383P", 16383 * 1024**5),
]


@pytest.mark.parametrize(("text", "size"), FLUX_SIZES)
def test_parse_flux_size_takes_what_flux_takes(text, size):
    if size is None:
        with pytest.raises(ValueError, match=r"is not a size|is too large"):
            parse_flux_size(text)
    else:
        assert parse_flux_size(text) == size


@pytest.mark.parametrize(
    "text", ["1E20", "16E", "0x10000000000000000", "1e400", "0x1p1024", "0x1p99999"]
)
def test_a_flux_size_past_64_bits_is_too_large(text):
    with pytest.raises(SizeTooLarge, match=r"is too large \(16E or more\)"):
        parse_flux_size(text)


@pytest.mark.parametrize(
    "text", ["9" * 999_990 + "K", "0x" + "f" * 999_990, "0" + "7" * 999_990]
)
def test_a_flux_size_of_a_million_digits_is_refused_at_once(text):
    # int() of a million decimal digits raises (Python's digit limit) or
    # costs seconds; the count of digits says first that it overflows.
    with pytest.raises(SizeTooLarge):
        parse_flux_size(text)


@pytest.mark.parametrize(("text", "size"), [row for row in FLUX_SIZES if row[1]])
def test_a_memory_limit_s_size_is_what_flux_reads(text, size):
    # Flux's sdexec reads MemoryMax and the other limits with parse_size
    # (flux-core src/common/libsdexec/start.c, prop_add).
    assert MemoryLimit.parse(text) == MemoryLimit(bytes=size)


G = 1024**3
# A memory limit's size, as Flux's sdexec reads it, or as sdexec kept it
# (upstream refuses these); None: refused.
MEMORY_SIZES = [
    # Flux's reading
    ("0x40000000", G),
    ("0x1e", 30),  # a hex digit, not exa
    ("0x1B", 27),  # a hex digit, not bytes
    ("077", 63),
    ("0100M", 64 * 1024**2),
    ("09M", 9 * 1024**2),  # not octal: strtold reads it
    ("1.5e9", 1_500_000_000),
    ("0.7K", 716),  # rounded down, as Flux does
    ("0x.8G", G // 2),
    ("+1G", G),
    ("\t1G", G),
    ("1.5G", 3 * G // 2),
    # kept: sdexec took them before, with this meaning; Flux refuses them
    ("4g", 4 * G),
    ("1e", 1024**6),
    ("512B", 512),
    ("512b", 512),
    ("64 M", 64 * 1024**2),
    ("1G ", G),
    ("0100 M", 64 * 1024**2),  # octal still, as without the space
    # refused by both
    ("1KB", None),
    ("1 e3", None),
    ("1e3m", None),
    ("-1G", None),
    ("1_000", None),
    ("\uff11G", None),
    ("0x", None),
    ("nan", None),
    ("inf", None),
    ("Infinity", None),
    ("1G 512M", None),
]


@pytest.mark.parametrize(("text", "size"), MEMORY_SIZES)
def test_a_memory_limit_s_size(text, size):
    if size is None:
        with pytest.raises(ValueError, match=r"is not a size|sum of sizes"):
            MemoryLimit.parse(text)
    else:
        assert MemoryLimit.parse(text) == MemoryLimit(bytes=size)


# A percentage as Flux's sdexec_parse_percent reads it (strtod, "%"), in
# ten-thousandths; None: refused (ValueError), "decimals": finer than 0.01%,
# which Flux takes and sdexec refuses, saying so.
MEMORY_PERCENTS = [
    ("50%", 5000),
    (" 50%", 5000),
    ("+50%", 5000),
    ("5e1%", 5000),
    ("0x32%", 5000),
    ("0x1.8p1%", 300),
    ("50.000%", 5000),
    (".5%", 50),
    ("5.%", 500),
    ("007%", 700),
    ("-0%", 0),
    ("0.01%", 1),
    ("100%", 10_000),
    ("1" + "0" * 100_000 + "e-100000%", 100),
    ("3.125%", "decimals"),
    ("1e-3%", "decimals"),
    ("0x1p-20%", "decimals"),
    ("101%", "100"),
    ("1e999999999%", "100"),
    ("0x1p99999%", "100"),
    ("nan%", None),
    ("inf%", None),
    ("-5%", None),
    ("95 %", None),
    ("50%%", None),
    ("%", None),
    ("0x%", None),
]


@pytest.mark.parametrize(("text", "permyriad"), MEMORY_PERCENTS)
def test_a_memory_limit_s_percentage(text, permyriad):
    if permyriad is None:
        with pytest.raises(ValueError, match="is not a") as error:
            MemoryLimit.parse(text)
        assert not isinstance(error.value, SizeNotTaken)
    elif permyriad == "decimals":
        with pytest.raises(SizeNotTaken, match="more than two decimals"):
            parse_flux_percent(text)
    elif permyriad == "100":
        with pytest.raises(SizeNotTaken, match="more than 100%"):
            parse_flux_percent(text)
    else:
        assert MemoryLimit.parse(text) == MemoryLimit(permyriad=permyriad)


@pytest.mark.parametrize(
    ("text", "differs"),
    [("0100M", True), ("077", True), (" 010 g", True), ("007", False),
     ("0", False), ("00", False), ("09", False), ("0x10", False),
     ("0.5G", False), ("100M", False), ("050%", False)],
)  # fmt: skip
def test_octal_differs_where_the_old_decimal_reading_did(text, differs):
    assert octal_differs(text) is differs
