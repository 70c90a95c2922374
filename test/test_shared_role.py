"""The users of ``allow-users`` share the owner's role whole (upstream's
sdexec serves its instance owner alone): one set of processes, whoever
started them, as docs/configuration.md (``allow-users``) says. Against the
real service and the test systemd manager, the other user a child forked
as uid 65534 (its peer credentials the kernel's, not a patched lookup)."""

from __future__ import annotations

import errno
import re

import pytest
from pytest_twisted import ensureDeferred
from support import ConfigText, RunningService, command
from test_sockets import NOBODY, sdexec_as_nobody

from sdexec.client import RPCError

pytestmark = pytest.mark.systemd

#: The flags of a waitable background exec (docs/protocol.md, flag 16).
WAITABLE = 16


async def _shared_service(shared_dir) -> RunningService:
    allowed = ConfigText(sdexec=f'socket-mode = "0666"\nallow-users = [{NOBODY}]')
    return await RunningService(shared_dir, allowed).start()


@ensureDeferred
async def test_a_listed_user_s_wait_takes_the_owner_s_process_s_end(
    user_manager, shared_dir
):
    # Flux's job-exec, the owner, waits for its job shell; a listed user's
    # wait for it first is answered, and the owner's is then ESRCH.
    service = await _shared_service(shared_dir)
    try:
        owner = await service.connect()
        shell = owner.exec(command(["true"], label="shell"), WAITABLE, background=True)
        await shell.done
        status, said = await sdexec_as_nobody(service.socket_path, "wait", "shell")
        with pytest.raises(RPCError) as refused:
            await owner.wait(label="shell")
    finally:
        await service.stop()
    assert (status, said) == (0, b"")
    assert refused.value.errnum == errno.ESRCH


@pytest.mark.parametrize(
    ("option", "opts", "label", "refusal"),
    [
        (
            "--label=shell",
            {},
            "shell",
            rf"label 'shell' is already in use by pid \d+ of uid {NOBODY}",
        ),
        (
            "--setopt=SDEXEC_NAME=shell-f1",
            {"SDEXEC_NAME": "shell-f1"},
            None,
            r"unit shell-f1\.service is already run by this service",
        ),
        (
            "--jobid=f1",
            {"SDEXEC_JOBID": "f1"},
            None,
            rf"SDEXEC_JOBID: job f1 is running \(pid \d+ of uid {NOBODY}\)",
        ),
    ],
)
@ensureDeferred
async def test_a_listed_user_s_name_is_eexist_to_the_owner(
    user_manager, shared_dir, option, opts, label, refusal
):
    # A unit name, label or job id a listed user holds is the owner's too:
    # the owner's next job with it is refused while it runs, naming whose
    # process holds it (the refusal said nothing of it).
    service = await _shared_service(shared_dir)
    try:
        owner = await service.connect()
        status, said = await sdexec_as_nobody(
            service.socket_path, "run", "--bg", option, "sleep", "300"
        )
        taken = owner.exec(
            command(["true"], opts=opts, label=label), 0, background=True
        )
        with pytest.raises(RPCError) as refused:
            await taken.done
    finally:
        await service.stop()
    assert status == 0, said
    assert refused.value.errnum == errno.EEXIST
    assert re.fullmatch(refusal, refused.value.errstr), refused.value.errstr
