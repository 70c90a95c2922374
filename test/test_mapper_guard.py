"""HwlocMapper's refusal of an R with nothing to fence, whatever a subclass
adds before calling ``finalize_properties`` (review 32 L, F1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sdexec.map import HwlocMapper
from sdexec.map.mapper import UnfenceableRequest
from sdexec.rset import ResourceSet

LARGE = (Path(__file__).parent / "data" / "large.xml").read_text()


def make_R(**children: str) -> dict:
    """R version 1 giving rank 0 the ``children`` (core="0-1", gpu="0")."""
    return {
        "version": 1,
        "execution": {"R_lite": [{"rank": "0", "children": children}]},
    }


class AccountingMapper(HwlocMapper):
    """flux-config-exec(5)'s example: its properties go in before super()."""

    def finalize_properties(self, properties, R, extra_properties=None):
        properties.update({"CPUAccounting": "true", "MemoryAccounting": "true"})
        return super().finalize_properties(
            properties, R, extra_properties=extra_properties
        )


class NodeDeviceMapper(HwlocMapper):
    """A site that opens one device to every job: a device fence, not a CPU one."""

    def finalize_properties(
        self, properties, R: ResourceSet, extra_properties=None
    ) -> dict:
        properties["DeviceAllow"] = "/dev/infiniband/uverbs0 rw"
        return super().finalize_properties(
            properties, R, extra_properties=extra_properties
        )


@pytest.mark.parametrize("mapper_class", [AccountingMapper, NodeDeviceMapper])
@pytest.mark.parametrize(
    ("children", "held"),
    [({}, "none"), ({"core": ""}, "core=''"), ({"cores": "0-3"}, "cores='0-3'")],
    ids=["no-children", "empty-cores", "misspelt"],
)
def test_properties_a_subclass_adds_first_do_not_let_an_R_without_cores_through(
    mapper_class, children, held
):
    # They did: the guard asked whether any property had been made, and the
    # job ran on every CPU with the site's MemoryMax unscaled.
    with pytest.raises(UnfenceableRequest) as error:
        mapper_class(LARGE).map(
            make_R(**children), extra_properties={"MemoryMax": "50%"}
        )
    assert str(error.value) == (
        f"R gives rank 0 no cores and no GPUs to fence (its children: {held}):"
        " a job is never run unconstrained"
    )


def test_a_subclass_adding_properties_still_fences_an_R_with_cores():
    result = AccountingMapper(LARGE).map(
        make_R(core="0-15"), extra_properties={"MemoryMax": "50%"}
    )
    assert result["AllowedCPUs"] == "0-15,64-79"
    assert result["CPUAccounting"] == "true"
    assert result["MemoryMax"] == "12.5%"  # 50% of 32 of 128 PUs
