"""RFC 20 R version 1: per-rank children, counts, copy_ranks, malformed R."""

from __future__ import annotations

import json

import pytest

from sdexec.idset import IDset
from sdexec.rset import ResourceSet


def make_R(*entries: tuple[str, dict[str, str]], **execution) -> dict:
    """R version 1 with one R_lite entry per (ranks, children) pair."""
    R_lite = [{"rank": ranks, "children": children} for ranks, children in entries]
    return {"version": 1, "execution": {"R_lite": R_lite, **execution}}


TWO_ENTRIES = make_R(
    ("0-1", {"core": "0-3", "gpu": "0"}),
    ("3", {"core": "0-7"}),
    nodelist=["node[0-1,3]"],
    starttime=1700000000.5,
    expiration=1700003600,
)


@pytest.mark.parametrize("R", [TWO_ENTRIES, json.dumps(TWO_ENTRIES)])
def test_accepts_a_dict_or_json(R):
    rset = ResourceSet(R)
    assert rset.ranks == IDset("0-1,3")
    assert rset.starttime == 1700000000.5
    assert rset.expiration == 1700003600


def test_children_are_per_rank():
    rset = ResourceSet(TWO_ENTRIES)
    assert rset.children(1) == {"core": IDset("0-3"), "gpu": IDset("0")}
    assert rset.children(3) == {"core": IDset("0-7")}
    assert rset.children(2) == {}


def test_children_returns_a_copy():
    rset = ResourceSet(TWO_ENTRIES)
    rset.children(0)["core"] = IDset()
    assert rset.children(0)["core"] == IDset("0-3")


def test_counts_are_over_all_ranks():
    rset = ResourceSet(TWO_ENTRIES)
    assert rset.ncores == 4 + 4 + 8
    assert rset.ngpus == 2
    assert rset.count("fpga") == 0


@pytest.mark.parametrize(
    ("ranks", "kept", "ncores"),
    [
        (0, "0", 4),
        (3, "3", 8),
        ("1,3", "1,3", 12),
        ("[0-1]", "0-1", 8),
        (IDset("0,3"), "0,3", 12),
        ("2", "", 0),
        (7, "", 0),
    ],
)
def test_copy_ranks(ranks, kept, ncores):
    local = ResourceSet(TWO_ENTRIES).copy_ranks(ranks)
    assert local.ranks == IDset(kept)
    assert local.ncores == ncores
    assert local.expiration == 1700003600


def test_copy_ranks_leaves_the_original_alone():
    rset = ResourceSet(TWO_ENTRIES)
    rset.copy_ranks(3)
    assert rset.ranks == IDset("0-1,3")


def test_membership_and_repr():
    rset = ResourceSet(TWO_ENTRIES)
    assert 3 in rset
    assert 2 not in rset
    assert repr(rset) == "ResourceSet(ranks='0-1,3')"


def test_optional_fields_may_be_absent():
    rset = ResourceSet(make_R(("0", {"core": "0"})))
    assert rset.starttime is None
    assert rset.expiration is None


def test_empty_R_lite_is_an_empty_set():
    rset = ResourceSet(make_R())
    assert rset.ranks == IDset()
    assert rset.ncores == 0


@pytest.mark.parametrize(
    ("R", "message"),
    [
        ("{", "R: not valid JSON: Expecting property name"),
        ("[]", "R: expected a JSON object, got an array"),
        (7, "R: expected a JSON object, got the number 7"),
        ({"execution": {}}, "R: version: expected 1, got None"),
        ({"version": 2, "execution": {}}, "R: version: expected 1, got 2"),
        ({"version": True, "execution": {}}, "R: version: expected 1, got true"),
        ({"version": 1.0, "execution": {}}, "R: version: expected 1, got 1.0"),
        ({"version": 1}, "R: execution: missing"),
        ({"version": 1, "execution": []}, "R: execution: expected an object"),
        ({"version": 1, "execution": {}}, "R: execution.R_lite: missing"),
        (
            {"version": 1, "execution": {"R_lite": {}}},
            "R: execution.R_lite: expected an array, got an object",
        ),
        (
            {"version": 1, "execution": {"R_lite": ["0"]}},
            "R: execution.R_lite[0]: expected an object, got the string '0'",
        ),
        (
            {"version": 1, "execution": {"R_lite": [{"children": {}}]}},
            "R: execution.R_lite[0].rank: missing",
        ),
        (
            make_R(("0", {"core": "0"}), ("x", {})),
            "R: execution.R_lite[1].rank: invalid idset 'x': 'x' is not an id",
        ),
        (
            {"version": 1, "execution": {"R_lite": [{"rank": 0, "children": {}}]}},
            "R: execution.R_lite[0].rank: expected a string, got the number 0",
        ),
        (
            {"version": 1, "execution": {"R_lite": [{"rank": "0"}]}},
            "R: execution.R_lite[0].children: missing",
        ),
        (
            make_R(("0", {"core": "3-1"})),
            "R: execution.R_lite[0].children.core: invalid idset '3-1'",
        ),
        (
            make_R(("0", {"gpu": None})),
            "R: execution.R_lite[0].children.gpu: expected a string, got null",
        ),
        (
            make_R(("0-2", {}), ("2", {})),
            "R: execution.R_lite[1].rank: rank 2 is already in execution.R_lite[0]",
        ),
        (
            make_R(starttime="now"),
            "R: execution.starttime: expected a number, got the string 'now'",
        ),
        (
            make_R(expiration=True),
            "R: execution.expiration: expected a number, got a boolean",
        ),
        ("[" * 100_000, "R: not valid JSON: nested too deeply"),
        ('{"version": 1, "execution": {"expiration": NaN}}', "R: not valid JSON: NaN"),
        (
            '{"version": 1, "execution": {"expiration": ' + "9" * 5000 + "}}",
            "R: not valid JSON: an integer of 5000 digits",
        ),
        (
            make_R(expiration=10**400),
            "R: execution.expiration: 1000000000000000000000000000000000000000… (401"
            " chars) is out of range",
        ),
        (make_R(starttime=float("inf")), "R: execution.starttime: inf is out of range"),
        (
            make_R(expiration=10**5000),  # past what Python writes in decimal
            "R: execution.expiration: <an integer of 16610 bits> is out of range",
        ),
        (
            make_R(starttime=-(2.0**62)),
            "R: execution.starttime: -4.611686018427388e+18 is out of range",
        ),
    ],
)
def test_malformed_R_names_the_field(R, message):
    with pytest.raises(ValueError) as failure:
        ResourceSet(R)
    assert str(failure.value).startswith(message)
    # The message is the whole story: no chained traceback from deep inside.
    assert failure.value.__cause__ is None
    assert failure.value.__suppress_context__ or failure.value.__context__ is None


def test_copy_ranks_rejects_a_bad_idset():
    with pytest.raises(ValueError, match="invalid idset 'a'"):
        ResourceSet(TWO_ENTRIES).copy_ranks("a")


def test_a_huge_rank_range_costs_its_text_not_its_ranks():
    # Gigabytes and minutes if each rank were held (or walked) one by one.
    rset = ResourceSet(make_R(("0-4294967292", {"core": "0-3"}), ("4294967293", {})))
    assert rset.ncores == 4 * 4294967293
    assert rset.children(4000000000) == {"core": IDset("0-3")}
    assert rset.copy_ranks(7).ncores == 4


def test_a_rank_repeated_among_many_entries_is_found_and_named():
    entries = [(str(rank), {"core": "0"}) for rank in range(20_000)]
    entries.append(("19000-19001", {}))
    with pytest.raises(ValueError) as failure:
        ResourceSet(make_R(*entries))
    assert str(failure.value) == (
        "R: execution.R_lite[20000].rank: rank 19000 is already in"
        " execution.R_lite[19000]"
    )
