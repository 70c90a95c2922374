"""The one exception the request checks raise: an errno and a message.

:mod:`sdexec.limits` and :mod:`sdexec.policy` check a request before anything
is started or tabled; they refuse it with :class:`RequestRefused`, which the
server answers as an RFC 6 error response (``errnum``, ``errstr``). The
message always names the field or property that was wrong, and is always
encodable as UTF-8 JSON, whatever the request contained (see
:func:`printable`).

Also the text helpers every error message is written with, on both sides
of the socket: the service's and the command line's (this module imports
nothing heavy, so the lean client may). One rule for how much of a value
a message quotes: :data:`SHOWN` characters, whether written as text
(:func:`printable`), as Python writes it (:func:`quoted`) or as JSON
(:func:`json_quoted`); and one rule for how a message is kept on one
line (:func:`one_line`).
"""

from __future__ import annotations

import errno

TYPE_CHECKING = False  # not typing's: the command line imports this module
if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "MAX_ERRSTR",
    "MISSING",
    "NAMED",
    "SHOWN",
    "RequestRefused",
    "errno_name",
    "errstr_line",
    "expected",
    "first_named",
    "json_quoted",
    "lone_surrogate",
    "member",
    "one_line",
    "printable",
    "quoted",
]

#: Characters of a request's value (or of a field named by a request's key)
#: an error message quotes: any value a person writes, whole; a hostile one
#: of megabytes is cut, with its length, so the message keeps saying why.
SHOWN = 200


#: How many units, jobs, connections or drain causes one line names: a
#: person reads that many; the rest are counted (:func:`first_named`).
NAMED = 10


#: Linux's own names for the errnos that have two, where Python's table
#: gives the alias (EDEADLOCK, ENOTSUP): the ones docs/protocol.md uses.
_LINUX_NAMES = {errno.EDEADLK: "EDEADLK", errno.EOPNOTSUPP: "EOPNOTSUPP"}


def errno_name(errnum: int) -> str:
    """``errnum``'s symbolic name as Linux's headers give it (``ESRCH``),
    ``errno N`` for one without a name: the one naming of an errno, the
    service's messages and the clients' alike."""
    return _LINUX_NAMES.get(errnum) or errno.errorcode.get(errnum, f"errno {errnum}")


class RequestRefused(Exception):
    """A request refused before it had any effect.

    ``errnum`` is the Linux errno for the error response, ``errstr`` its
    one-line message naming what was wrong.
    """

    def __init__(self, errnum: int, errstr: str) -> None:
        super().__init__(errstr)
        self.errnum = errnum
        self.errstr = errstr


def printable(text: str, limit: int | None = None) -> str:
    """``text`` made safe to quote in an error message: lone surrogates
    become ``\\udXXX`` escapes, so the message itself can always be encoded
    (a message quoting a bad ``topic`` verbatim could not be sent); cut short
    past ``limit`` characters (:data:`SHOWN` for what a request chose), with
    how long it was."""
    return _cut(
        text.encode("utf-8", "backslashreplace").decode("utf-8"), limit, len(text)
    )


def member(table: str, key: str, limit: int = SHOWN) -> str:
    """The field name of ``key`` in the object ``table``, as a message
    names it: ``cmd.env.PATH`` for a key spelled as a C name, else the key
    quoted as :func:`quoted` quotes values, in brackets as an argument's
    index is (``cmd.cmdline[2]``): ``cmd.env['']``, ``cmd.env['A.B']``,
    ``cmd.opts['A B']``. After a dot, an empty key or one holding a dot read
    as a path of their own (``cmd.env..``, ``cmd.env.A.B``). Cut past
    ``limit`` characters, with the length."""
    # A C name: ASCII letters, digits and "_", not a digit first ("" not).
    c_name = key.isascii() and key.replace("_", "a").isalnum()
    if c_name and not key[0].isdigit():
        return f"{table}.{_cut(key, limit)}"
    return f"{table}[{quoted(key, limit)}]"


def first_named(names: Sequence[str], sep: str = ", ", more: str = "more") -> str:
    """``names`` joined by ``sep`` for one line, the first :data:`NAMED`
    of them and then ``and K more`` (``more``: what the rest are, and
    where each is said). Hundreds of units in one line (a shutdown's
    stragglers, an undrain's causes) made a line of tens of kilobytes,
    which journald splits past its ``LineMax`` and nobody reads."""
    if len(names) <= NAMED:
        return sep.join(names)
    return f"{sep.join(names[:NAMED])} and {len(names) - NAMED} {more}"


def lone_surrogate(value: str, error: UnicodeEncodeError) -> str:
    """Why ``value`` did not encode as UTF-8 (``error``), for a message
    that names its field: the one thing a JSON string can hold that UTF-8
    cannot."""
    return (
        f"not valid Unicode text: lone surrogate U+{ord(value[error.start]):04X}"
        f" at {error.start}"
    )


def quoted(value: object, limit: int | None = 40) -> str:
    """``repr(value)`` for a message, cut short past ``limit`` characters,
    with how long it was: a hostile value may be megabytes."""
    if isinstance(value, int) and value.bit_length() > _MAX_WRITABLE_INT_BITS:
        return f"<an integer of {value.bit_length()} bits>"
    return _cut(repr(value), limit, _characters(value))


def _cut(text: str, limit: int | None, length: int | None = None) -> str:
    """``text``, or its first ``limit`` characters and how long it was:
    ``length``, the characters of the value ``text`` writes, else its own.
    A string's own, not its quoted form's: a label of 1048576 characters
    said "(1048578 chars)", quotes counted, and one of escape codes four
    times its length."""
    if limit is None or len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) if length is None else length} chars)"


def _characters(value: object) -> int | None:
    """How many characters a string ``value`` has (``None`` for another:
    its written form is what a message counts)."""
    return len(value) if isinstance(value, str) else None


def one_line(text: str) -> str:
    """``text`` as one line that can always be shown and sent: each
    character :meth:`str.isprintable` refuses (a line break, a terminal's
    escape, a bidirectional override, a lone surrogate) written as
    :func:`repr` writes it (``\\n``, ``\\x1b``, ``\\u202e``, ``\\ud800``),
    so that a key the request chose reads as its ``repr`` (``cmd.env['A\\nB']``).
    Every ``errstr``, where the service sends it and where a client shows
    it, every ``sd_notify`` line and every cell of a listing."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


#: The longest ``errstr`` sent or shown: a message quoting a request's value
#: (a 10 MB option) must not become a frame the client cannot take, and a
#: service's 100 kB one is no message a person reads whole either.
MAX_ERRSTR = 4096


def errstr_line(errstr: str) -> str:
    """``errstr`` as the service sends it and a client shows it: one line
    (:func:`one_line`) of at most :data:`MAX_ERRSTR` characters, a longer
    one cut with "…"."""
    # Cut before it is escaped too: escaping a long one is a loop in Python.
    text = one_line(errstr[: MAX_ERRSTR + 1])
    return text if len(text) <= MAX_ERRSTR else text[: MAX_ERRSTR - 1] + "…"


#: Past about 4300 digits, Python will not write an integer in decimal.
_MAX_WRITABLE_INT_BITS = 14_000


#: Characters of a value an error message quotes as JSON: :data:`SHOWN`,
#: as for any other value. It was 1000 ("a long path whole"), but a JSON
#: value is as often a request's (``matchtag``, ``cwd``, ``detail``, a
#: signal) as a configuration's, and a request's ``cwd`` quoted five times
#: as far as its ``opts`` broke the one rule for no reason; a configuration
#: value cut at 200 is still found whole in the file, by the key the
#: message names.
JSON_QUOTE_LIMIT = SHOWN


def json_quoted(value: object, limit: int = JSON_QUOTE_LIMIT) -> str:
    """A value as JSON writes it, as the admin writes a configuration or
    a client a request: ``"5x"``, ``true``, ``12``; cut short past
    ``limit`` characters. A string or an integer cut says its length, as
    :func:`quoted` does; an array or object cut says only "…": a YAML file
    of a few hundred bytes can alias its way to a billion items, or to
    itself, so only as much of it is written as is shown, and its whole
    length is never known."""
    if not isinstance(value, dict | list):
        return _cut(_json_scalar(value), limit, _characters(value))
    text = _json_prefix(value, limit + 1, depth=0)
    return text if len(text) <= limit else f"{text[:limit]}…"


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


#: A field's value where the field is absent (``obj.get(key, MISSING)``),
#: said "none" by :func:`expected`: a JSON null is one the sender wrote.
MISSING = _Missing()


def expected(field: str, said: str, value: object, limit: int = SHOWN) -> str:
    """``FIELD: expected SAID, got VALUE``, the value as JSON writes it
    (:func:`json_quoted`, cut past ``limit``), or ``got none`` for
    :data:`MISSING`: the one form of a refusal of a mistyped field, the
    service's of a request's and a client's of an answer's, so that each
    says what came as well as what was wanted."""
    got = "none" if value is MISSING else json_quoted(value, limit)
    return f"{field}: expected {said}, got {got}"


def _json_prefix(value: object, budget: int, depth: int) -> str:
    """``value`` as JSON, at least its first ``budget`` characters if it has
    that many; nesting below 8 levels (a self-alias has no bottom) is "…"."""
    import json  # here: the command line quotes no value unless it refuses

    if isinstance(value, dict | list):
        if depth >= 8:
            return "…"
        items = value.items() if isinstance(value, dict) else enumerate(value)
        parts: list[str] = []
        used = 2
        for key, item in items:
            if used >= budget:
                break
            prefix = f"{json.dumps(str(key))}: " if isinstance(value, dict) else ""
            parts.append(prefix + _json_prefix(item, budget - used, depth + 1))
            used += len(parts[-1]) + 2
        ends = "{}" if isinstance(value, dict) else "[]"
        return ends[0] + ", ".join(parts) + ends[1]
    if isinstance(value, str):
        value = value[:budget]  # an item past what is shown is cut anyway
    return _json_scalar(value)


def _json_scalar(value: object) -> str:
    """``value``, neither an array nor an object, as JSON writes it."""
    import json  # here: the command line quotes no value unless it refuses

    if isinstance(value, int) and not isinstance(value, bool):
        return quoted(value, limit=None)  # as JSON writes it, unless too long
    return json.dumps(value, default=str)
