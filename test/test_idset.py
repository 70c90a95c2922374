"""RFC 22 idsets: parsing, canonical encoding, set operations, bitmasks."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sdexec.idset import MAX_ID, IDset

ids = st.frozensets(st.integers(min_value=0, max_value=300), max_size=60)


@pytest.mark.parametrize(
    ("text", "members"),
    [
        ("", []),
        ("[]", []),
        ("7", [7]),
        ("0-3", [0, 1, 2, 3]),
        ("0-3,7", [0, 1, 2, 3, 7]),
        ("[0-3,7]", [0, 1, 2, 3, 7]),
        (" [ 0-1 , 5 ] ", [0, 1, 5]),
        ("7,0-2", [0, 1, 2, 7]),
        ("1-3,2-5", [1, 2, 3, 4, 5]),
        ("4-4", [4]),
    ],
)
def test_decode(text, members):
    assert list(IDset.decode(text)) == members


@pytest.mark.parametrize(
    ("members", "text"),
    [
        ([], ""),
        ([5], "5"),
        ([0, 1], "0-1"),
        ([3, 0, 1, 2, 7], "0-3,7"),
        ([0, 2, 4], "0,2,4"),
        ([9, 10, 11, 20, 21], "9-11,20-21"),
    ],
)
def test_encode_is_canonical(members, text):
    assert IDset(members).encode() == text
    assert str(IDset(members)) == text


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("a", "'a' is not an id"),
        ("0-", "'' is not an id"),
        ("-1", "'' is not an id"),
        ("1,,2", "'' is not an id"),
        ("3-1", "range '3-1' is descending"),
        ("1-2-3", "'2-3' is not an id"),
        ("[0-3", "'[0' is not an id"),
        ("0x1", "'0x1' is not an id"),
        # An Arabic-Indic digit one: str.isdigit() says yes, RFC 22 says no.
        ("\u0661", "'\u0661' is not an id"),
    ],
)
def test_decode_errors_name_the_text_and_the_token(text, complaint):
    with pytest.raises(ValueError, match="invalid idset") as failure:
        IDset(text)
    assert repr(text) in str(failure.value)
    assert complaint in str(failure.value)


@pytest.mark.parametrize("member", [-1, 1.0, "1", True])
def test_members_must_be_non_negative_integers(member):
    with pytest.raises(ValueError, match="is not an integer from 0 to 4294967293"):
        IDset([0, member])


@given(ids)
def test_encode_decode_round_trip(members):
    encoded = IDset(members).encode()
    assert IDset(encoded) == IDset(members)
    assert IDset(f"[{encoded}]") == IDset(members)
    assert IDset(encoded).encode() == encoded


@given(ids)
def test_iteration_is_ascending_and_length_counts_members(members):
    idset = IDset(members)
    assert list(idset) == sorted(members)
    assert len(idset) == len(members)
    assert bool(idset) == bool(members)
    assert all(i in idset for i in members)


@given(ids)
def test_ranges_are_maximal_runs(members):
    runs = list(IDset(members).ranges())
    assert [i for lo, hi in runs for i in range(lo, hi + 1)] == sorted(members)
    # Maximal: consecutive runs are separated by at least one missing id.
    assert all(next_lo > hi + 1 for (_, hi), (next_lo, _) in pairwise(runs))


@given(ids, ids)
def test_set_operations_agree_with_python_sets(a, b):
    left, right = IDset(a), IDset(b)
    assert left | right == IDset(a | b)
    assert left & right == IDset(a & b)
    assert left - right == IDset(a - b)
    assert left ^ right == IDset(a ^ b)
    assert left.issubset(right) == (a <= b)


@given(ids)
def test_bitmask_round_trip(members):
    assert IDset.from_bitmask(IDset(members).bitmask()) == IDset(members)


def test_bitmask_layout_matches_systemd():
    # systemd's CPU masks put id i at bit i % 8 of byte i // 8.
    assert IDset("0,9").bitmask() == bytes([0b00000001, 0b00000010])
    assert IDset().bitmask() == b""


def test_equal_sets_hash_alike_and_repr_shows_the_encoding():
    assert hash(IDset("0-2")) == hash(IDset([2, 1, 0]))
    assert {IDset("0-2"): "x"}[IDset("[0,1,2]")] == "x"
    assert repr(IDset("0-2,5")) == "IDset('0-2,5')"
    assert IDset("1") != "1"


def test_last():
    assert IDset("9,3-4").last() == 9
    with pytest.raises(ValueError, match="empty idset"):
        IDset().last()


# Sets are kept as runs: each of these would take gigabytes, and minutes, if
# the ids were held (or walked) one by one.
EVERY_ID = f"0-{MAX_ID}"


def test_a_set_of_every_id_costs_its_text_not_its_ids():
    every = IDset(EVERY_ID)
    assert len(every) == MAX_ID + 1
    assert every.encode() == EVERY_ID
    assert MAX_ID in every and MAX_ID + 1 not in every and -1 not in every
    assert list(every.ranges()) == [(0, MAX_ID)]
    assert IDset(range(MAX_ID + 1)) == every


def test_operations_on_huge_sets_work_run_by_run():
    every, some = IDset(EVERY_ID), IDset("5-9,4000000000-4000000001")
    assert every - some == IDset(f"0-4,10-3999999999,4000000002-{MAX_ID}")
    assert every & some == some
    assert every | some == every
    assert every ^ some == every - some
    assert some.issubset(every) and not every.issubset(some)
    assert IDset.union(some, IDset("10-20"), IDset()) == IDset(
        "5-20,4000000000-4000000001"
    )


@pytest.mark.parametrize("text", [str(MAX_ID + 1), f"0-{MAX_ID + 1}", "9" * 5000])
def test_ids_beyond_the_largest_are_refused_naming_it(text):
    with pytest.raises(ValueError, match=f"is larger than the largest id, {MAX_ID}"):
        IDset(text)


def test_leading_zeros_are_any_number_of_zeros():
    # Python converts no more than 4300 digits, zeros included: its advice
    # to raise that limit was a request's error.
    assert IDset("0" * 5000 + "7") == IDset("7")
    assert IDset("0" * 5000) == IDset("0")
    with pytest.raises(ValueError, match=f"is larger than the largest id, {MAX_ID}"):
        IDset("0" * 5000 + str(MAX_ID + 1))


@pytest.mark.parametrize("member", [MAX_ID + 1, 2**64])
def test_members_beyond_the_largest_are_refused(member):
    with pytest.raises(ValueError, match=f"is not an integer from 0 to {MAX_ID}"):
        IDset([member])


@pytest.mark.parametrize(
    ("member", "shown"),
    [(10**5000, "<an integer of 16610 bits>"), ("x" * 1000, "'xxx")],
    ids=["digits", "text"],
)
def test_a_huge_member_is_refused_quoted_cut(member, shown):
    # repr() of 5000 digits raised Python's own "Exceeds the limit"
    # ValueError, naming no idset; a long string was quoted whole.
    with pytest.raises(ValueError) as refused:
        IDset([member])
    said = str(refused.value)
    assert said.startswith(f"idset member {shown}")
    assert said.endswith(f"is not an integer from 0 to {MAX_ID}") and len(said) < 200


def test_an_error_quotes_a_long_idset_cut_short():
    text = ",".join(map(str, range(100_000))) + ",x"
    with pytest.raises(ValueError) as failure:
        IDset(text)
    message = str(failure.value)
    assert len(message) < 200
    assert f"({len(text)} chars)" in message and "'x' is not an id" in message


@pytest.mark.parametrize(
    ("text", "max_runs", "shown"),
    [
        ("", 8, ""),
        ("0-3,7", 2, "0-3,7"),
        ("0-3,7,9-10", 2, "0-3,7,... (7 in all)"),
        (",".join(map(str, range(0, 200_000, 2))), 3, "0,2,4,... (100000 in all)"),
    ],
)
def test_abbreviated_names_the_first_runs_and_how_many_in_all(text, max_runs, shown):
    assert IDset(text).abbreviated(max_runs) == shown


@pytest.mark.parametrize(
    ("text", "first", "kept"),
    [("0-5,9", 2, "2-5,9"), ("0-5,9", 6, "9"), ("0-5", 6, ""), ("3", 0, "3")],
)
def test_at_least_keeps_the_ids_from_first_on(text, first, kept):
    assert IDset(text).at_least(first) == IDset(kept)
