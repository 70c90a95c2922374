"""conftest's ``logged_failures``: what it catches, so that a test cannot
pass while the code under it logs a traceback nobody looked at."""

from __future__ import annotations

import asyncio
import gc

from twisted.internet import defer
from twisted.logger import Logger


def test_a_failed_deferred_nobody_handled_is_caught(logged_failures):
    defer.fail(ValueError("dropped"))  # nobody holds it: collected, logged
    gc.collect()
    (failure,) = logged_failures.flush()
    assert failure.getErrorMessage() == "dropped"
    assert logged_failures.describe() == ""


def test_flush_takes_only_the_types_asked_for(logged_failures):
    log = Logger()
    for error in (ValueError("taken"), KeyError("left")):
        try:
            raise error
        except Exception:
            log.failure("a fault")
    assert [f.getErrorMessage() for f in logged_failures.flush(ValueError)] == ["taken"]
    assert "'a fault'" in logged_failures.describe()
    assert "KeyError: 'left'" in logged_failures.describe()
    assert [f.getErrorMessage() for f in logged_failures.flush()] == ["'left'"]


def test_an_asyncio_exception_never_retrieved_is_caught(logged_failures):
    future = asyncio.get_event_loop().create_future()
    future.set_exception(ValueError("unseen"))
    del future  # asyncio logs it when the future goes
    gc.collect()
    (record,) = logged_failures.stdlib.records
    assert "exception was never retrieved" in record and "ValueError: unseen" in record
    logged_failures.stdlib.records.clear()  # seen: it fails nothing
