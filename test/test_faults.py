"""Requests that used to hang or silence others, against the real manager:
a reused unit name, unit types the state model does not expect, a burst
of connections. Every request must end, and end only its own stream."""

from __future__ import annotations

import errno
import uuid

import pytest
from pytest_twisted import ensureDeferred
from support import FLAGS, command, run

pytestmark = pytest.mark.systemd


@ensureDeferred
async def test_a_unit_name_in_use_is_refused_and_its_owner_runs_on(sdexec):
    name = f"sdexec-dup-{uuid.uuid4().hex}"
    client = await sdexec.connect()
    first: list[dict] = []
    owner = client.exec(
        command(["sh", "-c", "read line; echo $line"], opts={"SDEXEC_NAME": name}),
        FLAGS,
        first.append,
    )
    second = await run(client, ["true"], opts={"SDEXEC_NAME": name})
    assert second.error.errnum == errno.EEXIST
    assert f"{name}.service is already run by this service" in second.error.errstr
    assert second.types == []
    owner.write(b"still here\n")
    owner.close_stdin()
    await owner.done  # ENODATA: the stream ended successfully
    assert [r["status"] for r in first if r["type"] == "finished"] == [0]
    assert sdexec.server.units == {}
