"""The output a background process keeps for ``sdexec.wait`` and ``attach``.

One :class:`RetainedOutput` per process holds the most recent stdout and
stderr, interleaved in the order they were produced, within a size from
``[sdexec] retained-output`` (:func:`parse_retained_size`; default 1 MiB,
``0`` keeps none). When more is produced, the *oldest bytes* are dropped:

- Drops are byte-exact, not whole chunks: the buffer always holds exactly the
  last ``size`` bytes produced (or all of them, if fewer). Whole-chunk
  dropping would make what is kept depend on how the pipe happened to be
  read, and a single chunk larger than the buffer would be either kept whole
  (unbounded) or lost whole. The cost: the oldest kept bytes may start in the
  middle of a line or of a UTF-8 character (that piece is then sent base64,
  as any non-UTF-8 data is).
- Per stream, the bytes dropped are counted exactly, for the extension key
  ``"dropped": {"stdout": N, "stderr": M}``.
- An ``attach`` replay (a :class:`Cursor` from the oldest byte) of a line-buffered
  stream whose oldest kept bytes are part-way into a line leaves out the
  start of what is kept, up to where a live message could start (see
  there), and counts it as dropped too: less than the stream's buffer size.
- The bookkeeping is bounded too: the stream and the end of each run of
  bytes are kept as two 8-byte entries, and runs are capped at
  ``size // 32 + 64``. Output that
  alternates between stdout and stderr in runs averaging under 32 bytes
  therefore keeps fewer than ``size`` bytes: the oldest whole runs go first,
  still counted byte-exactly as dropped.

Memory held: the data, in a ring ``bytearray`` that grows by doubling up to
exactly ``size`` bytes and no further, and the run table (16 bytes a run; the
runs already dropped stay until they are half of it, so at most
``size + 2048`` bytes, usually a few entries), plus a few hundred bytes.

Every byte produced has an absolute offset (:attr:`RetainedOutput.head` is
the next one's): a reader, an ``attach``, is a :class:`Cursor`, the offset
of the next byte it is to get and a few counts, however far behind it is.
It reads from the ring at its own pace, and what the ring drops before the
reader got it is counted, by stream, as lost to it (:meth:`Cursor.lost`).
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Collection, Iterator, Mapping
from typing import Any, Final

from sdexec.ioencode import encode_io, line_chunks
from sdexec.refusal import json_quoted
from sdexec.sizes import bounded_size, parse_size

__all__ = [
    "CONFIG_KEY",
    "DEFAULT_RETAINED",
    "STREAMS",
    "Cursor",
    "RetainedOutput",
    "parse_retained_size",
    "whole_pieces",
]

#: The configuration key for the size.
CONFIG_KEY: Final = "[sdexec] retained-output"
#: The default size, bytes per process (1 MiB).
DEFAULT_RETAINED: Final = 1024 * 1024
#: The streams kept, in the order of the ``dropped`` key.
STREAMS: Final = ("stdout", "stderr")
#: The smallest average run the bookkeeping is sized for (see module doc).
_MIN_AVERAGE_RUN: Final = 32
#: Runs always allowed, so a small buffer keeps short interleaved output
#: whole (1 KiB of run table at most).
_MIN_RUNS: Final = 64
#: How much a :class:`Cursor` reads out of the ring at once: its reader's
#: connection is full after about that much (its buffer is 256 KiB of
#: JSON), and what is read and not sent then is read again later.
READ_BATCH: Final = 64 * 1024


def parse_retained_size(value: object) -> int:
    """Bytes from the value of :data:`CONFIG_KEY`: a size string (``"1M"``,
    ``"64K"``, ``"0"``) or a non-negative integer; ``ValueError`` otherwise."""
    if isinstance(value, bool):
        raise ValueError(
            f"retained-output: expected a size such as 1M, got {json_quoted(value)}"
        )
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"retained-output: {value} is negative")
        return bounded_size(value, value)
    if not isinstance(value, str):
        raise ValueError(
            f"retained-output: expected a size such as 1M, got {json_quoted(value)}"
        )
    try:
        return parse_size(value)
    except ValueError as error:
        raise ValueError(f"retained-output: {error}") from None


class RetainedOutput:
    """A process's retained stdout and stderr, in the order the service
    passed them on.

    Runs are stored as signed lengths in an ``array('q')``: positive for
    stdout, negative for stderr; consecutive output of one stream extends its
    run. A second array holds the absolute offset each run ends at, so that
    a reader's offset is found in it by bisection.
    """

    def __init__(self, size: int = DEFAULT_RETAINED) -> None:
        if size < 0:
            raise ValueError(f"retained output size {size} is negative")
        self.size = size
        self._max_runs = size // _MIN_AVERAGE_RUN + _MIN_RUNS
        # A ring: held bytes start at _start and wrap around. It grows (by
        # doubling) only up to size, so a quiet process costs little and a
        # noisy one exactly size.
        self._ring = bytearray()
        self._start = 0
        self._held = 0
        self._runs = array("q")
        #: Where each run ends (absolute): the first held one starts at
        #: oldest, each other where the one before it ends.
        self._ends = array("q")
        self._first_run = 0  # runs before this index are gone (amortized pops)
        #: Bytes ever appended: the absolute offset of the next one.
        self._head = 0
        self._dropped = dict.fromkeys(STREAMS, 0)
        # How far into its line each stream's oldest kept byte is: bytes
        # dropped since the stream's last dropped newline (for replay).
        self._line_offset = dict.fromkeys(STREAMS, 0)
        self._eof: set[str] = set()

    @property
    def held(self) -> int:
        """Bytes of output held now (never more than :attr:`size`)."""
        return self._held

    @property
    def head(self) -> int:
        """The absolute offset of the next byte produced (bytes produced so
        far, dropped ones included)."""
        return self._head

    @property
    def oldest(self) -> int:
        """The absolute offset of the oldest byte held (:attr:`head` when
        none is)."""
        return self._head - self._held

    @property
    def dropped(self) -> dict[str, int]:
        """Bytes dropped so far, by stream: the ``dropped`` extension key."""
        return dict(self._dropped)

    @property
    def run_count(self) -> int:
        """Runs held now (at most ``size // 32 + 64``)."""
        return len(self._runs) - self._first_run

    def at_eof(self, stream: str) -> bool:
        """Whether ``stream`` has ended."""
        return stream in self._eof

    def append(self, stream: str, data: bytes) -> None:
        """Keep ``data``, just produced on ``stream`` (``stdout`` or
        ``stderr``), dropping the oldest output beyond :attr:`size`.
        ``ValueError`` for another stream or one already at EOF."""
        sign = self._sign(stream)
        if stream in self._eof:
            raise ValueError(f"{stream} is already at EOF")
        if not data:
            return
        self._head += len(data)
        excess = len(data) - self.size
        if excess > 0:
            # Never copy in what would be dropped at once. All that is held
            # goes first: it is older (the line offsets follow the order).
            self._drop(self._held)
            self._forget(stream, data, 0, excess)
            data = data[excess:]
        if not data:
            return
        self._make_room(len(data))
        self._write(data)
        if self.run_count and (self._runs[-1] > 0) == (sign > 0):
            self._runs[-1] += sign * len(data)
            self._ends[-1] = self._head
        else:
            self._runs.append(sign * len(data))
            self._ends.append(self._head)
        self._trim()

    def end(self, stream: str) -> None:
        """Mark ``stream`` at EOF (idempotent)."""
        self._sign(stream)
        self._eof.add(stream)

    def io_objects(self, rank: str) -> list[dict[str, Any]]:
        """The held output as RFC 24 io objects, oldest first, one per run
        (data only: EOFs are the caller's, see :meth:`at_eof`): a ``wait``
        answer's ``output``, with :attr:`dropped`."""
        return [encode_io(stream, rank, data) for stream, data in self._held_runs()]

    def read(self, offset: int, limit: int) -> list[tuple[str, bytes, int]]:
        """Held output from the absolute ``offset`` on, ``limit`` bytes at
        most, as ``(stream, data, end)`` per run: ``end`` is where the run
        ends (absolute), past the data where ``limit`` cut it.
        ``ValueError`` for an offset that is not held (dropped, or not yet
        produced)."""
        if not self.oldest <= offset <= self._head:
            raise ValueError(
                f"offset {offset} is not held: {self.oldest} to {self._head} are"
            )
        end = min(self._head, offset + limit)
        index = bisect_right(self._ends, offset, self._first_run)
        runs = []
        while offset < end:
            run_end = self._ends[index]
            stop = min(run_end, end)
            runs.append((self._stream_of(index), self._slice(offset, stop), run_end))
            offset = stop
            index += 1
        return runs

    def line_up(
        self, bufsizes: Mapping[str, int], line_buffered: Collection[str]
    ) -> tuple[dict[str, int], dict[str, int]]:
        """Where a replay of each stream starts (absolute: the stream's held
        bytes before it are left out), and how many bytes it so leaves out,
        by stream (see :class:`Cursor`)."""
        skip = {
            stream: self._misalignment(stream, bufsizes)
            if stream in line_buffered
            else 0
            for stream in STREAMS
        }
        starts = dict.fromkeys(STREAMS, self.oldest)
        left_out = dict.fromkeys(STREAMS, 0)
        offset = self.oldest
        for index in range(self._first_run, len(self._runs)):
            stream = self._stream_of(index)
            if not any(skip.values()):
                break
            if skip[stream]:
                # Only the bytes the skip may cover are looked at.
                stop = min(self._ends[index], offset + skip[stream])
                cut, skip[stream] = _line_up(self._slice(offset, stop), skip[stream])
                left_out[stream] += cut
                starts[stream] = offset + cut
            offset = self._ends[index]
        return starts, left_out

    def _misalignment(self, stream: str, bufsizes: Mapping[str, int]) -> int:
        """Bytes from the stream's oldest kept byte to where its line's next
        buffer would start (0 where it starts one, or is not split)."""
        bufsize = bufsizes.get(stream, 0)
        return -self._line_offset[stream] % bufsize if bufsize > 0 else 0

    def _held_runs(self) -> Iterator[tuple[str, bytes]]:
        data = self._contents()
        offset = 0
        for index in range(self._first_run, len(self._runs)):
            length = abs(self._runs[index])
            yield self._stream_of(index), data[offset : offset + length]
            offset += length

    def _stream_of(self, index: int) -> str:
        return STREAMS[0] if self._runs[index] > 0 else STREAMS[1]

    def _slice(self, start: int, stop: int) -> bytes:
        """The held bytes from absolute ``start`` to ``stop``."""
        position = (self._start + start - self.oldest) % max(len(self._ring), 1)
        count = stop - start
        first = min(count, len(self._ring) - position)
        with memoryview(self._ring) as ring:
            data = ring[position : position + first].tobytes()
            if count > first:
                data += ring[: count - first].tobytes()
        return data

    def _contents(self) -> bytes:
        end = self._start + self._held
        if end <= len(self._ring):
            return bytes(self._ring[self._start : end])
        return bytes(self._ring[self._start :] + self._ring[: end - len(self._ring)])

    def _make_room(self, count: int) -> None:
        """Drop what ``count`` new bytes displace; grow the ring if it is
        smaller than both what must be held and ``size``."""
        excess = self._held + count - self.size
        if excess > 0:
            self._drop(excess)
        needed = self._held + count
        if needed > len(self._ring):
            grown = min(self.size, max(needed, 2 * len(self._ring)))
            self._ring = bytearray(self._contents()) + bytes(grown - self._held)
            self._start = 0

    def _write(self, data: bytes) -> None:
        position = (self._start + self._held) % len(self._ring)
        first = min(len(data), len(self._ring) - position)
        self._ring[position : position + first] = data[:first]
        self._ring[: len(data) - first] = data[first:]
        self._held += len(data)

    @staticmethod
    def _sign(stream: str) -> int:
        if stream == STREAMS[0]:
            return 1
        if stream == STREAMS[1]:
            return -1
        raise ValueError(f"{stream!r} is not stdout or stderr")

    def _trim(self) -> None:
        while self.run_count > self._max_runs:
            self._drop(abs(self._runs[self._first_run]))
        if self._first_run > len(self._runs) // 2:
            del self._runs[: self._first_run]
            del self._ends[: self._first_run]
            self._first_run = 0

    def _drop(self, count: int) -> None:
        """Drop the oldest ``count`` bytes, run by run, counting them."""
        position = self._start
        self._start = (self._start + count) % max(len(self._ring), 1)
        self._held -= count
        while count:
            run = self._runs[self._first_run]
            taken = min(count, abs(run))
            self._forget_held(self._stream_of(self._first_run), position, taken)
            position = (position + taken) % len(self._ring)
            count -= taken
            if taken == abs(run):
                self._first_run += 1
            else:
                self._runs[self._first_run] = run - taken if run > 0 else run + taken

    def _forget_held(self, stream: str, position: int, count: int) -> None:
        """:meth:`_forget` the ``count`` bytes of the ring at ``position``
        (they may wrap round)."""
        first = min(count, len(self._ring) - position)
        self._forget(stream, self._ring, position, position + first)
        if count > first:
            self._forget(stream, self._ring, 0, count - first)

    def _forget(
        self, stream: str, data: bytes | bytearray, start: int, end: int
    ) -> None:
        """Count ``data[start:end]``, the oldest of ``stream``'s output, as
        dropped, and note how far into its line the stream's next byte is."""
        self._dropped[stream] += end - start
        newline = data.rfind(b"\n", start, end)
        if newline < 0:
            self._line_offset[stream] += end - start
        else:
            self._line_offset[stream] = end - newline - 1


def _line_up(data: bytes, skip: int) -> tuple[int, int]:
    """``(cut, left)``: how much of ``data``, a stream's next run, a replay
    leaves out to start where its live output could (up to ``skip`` bytes,
    or to the first newline within them), and how much more of the stream's
    next runs it must then leave out."""
    newline = data.find(b"\n", 0, skip)
    if newline >= 0:
        return newline + 1, 0
    cut = min(skip, len(data))
    return cut, skip - cut


def whole_pieces(data: bytes, step: int, line_buffered: bool) -> int:
    """How much of ``data`` may be sent before a cut that no live piece
    could end at (a read that stopped short of its run's end): ``data``
    starts where a live piece of its stream could, and so must what comes
    after the part sent. For a line-buffered stream, that is up to its last
    line end, and whole buffers (``step`` bytes) of the line after it, as
    :class:`~sdexec.systemd.channel.OutputChannel` hands them on: 0 where
    ``data`` holds neither. Any part of another stream."""
    if not line_buffered:
        return len(data)
    line_end = data.rfind(b"\n") + 1
    return line_end + (len(data) - line_end) // step * step


class Cursor:
    """One reader's place in a :class:`RetainedOutput` (an ``attach``'s):
    the absolute :attr:`offset` of the next byte it is to get, and how many
    bytes of each stream came before it. That is all it holds: the bytes
    are read out of the ring as the reader takes them (:meth:`pieces`).

    It starts at the replay's start (the oldest byte held, less what a
    line-buffered stream leaves out to start where a live piece could), and
    it moves past each piece before giving it. Output of a stream the
    reader does not take is passed over.

    A run longer than its stream's ``bufsizes`` entry is split at line
    ends, as live output is (:func:`sdexec.ioencode.line_chunks`): a client
    may size its buffer by ``<stream>_BUFSIZE``, and takes whole lines or a
    full buffer out of it. Live output of a stream in ``line_buffered``
    sends a long line in whole buffers from the line's start; where such a
    stream's oldest kept byte is part-way into a line, the replay starts
    where a live message could: after that line's end or at the next
    multiple of the buffer size into it, whichever comes first. What it
    leaves out (less than a buffer, which is all a stream kept where the
    retained output is no larger than its buffer) is counted in
    :attr:`dropped`. (Started anywhere else, the client would hold a piece
    of line that the next live buffer of that line overruns. A client of a
    stream not line-buffered holds no piece of line: its replay leaves
    nothing out.)
    """

    def __init__(
        self,
        retained: RetainedOutput,
        bufsizes: Mapping[str, int],
        line_buffered: Collection[str],
        streams: Collection[str] = STREAMS,
        read_batch: int = READ_BATCH,
    ) -> None:
        self.retained = retained
        self._read_batch = read_batch
        self._bufsizes = dict(bufsizes)
        self._line_buffered = frozenset(line_buffered)
        self._streams = frozenset(streams)
        #: The absolute offset of the next byte it is to get.
        self.offset = retained.oldest
        #: Bytes of each stream before offset: dropped, left out, or sent.
        self._passed = retained.dropped
        self._starts, left_out = retained.line_up(bufsizes, line_buffered)
        #: What a replay from here leaves out, by stream: the dropped bytes,
        #: and those the line-up leaves out (``attached``'s ``dropped``).
        self.dropped = {
            stream: self._passed[stream] + left_out[stream] for stream in STREAMS
        }

    def takes(self, stream: str) -> bool:
        """Whether the reader takes ``stream``'s output."""
        return stream in self._streams

    def advance(self, stream: str, count: int) -> None:
        """Move past the next ``count`` bytes, all of ``stream`` (a live
        piece, sent as it came, say)."""
        self.offset += count
        self._passed[stream] += count

    def lost(self) -> dict[str, int]:
        """Bytes of the streams it takes that the ring dropped before the
        reader got them, by stream (only those with any): empty where it
        lost none. Where only output of a stream it does not take was
        dropped, it moves up to the oldest byte held."""
        oldest = self.retained.oldest
        if self.offset >= oldest:
            return {}
        dropped = self.retained.dropped
        lost = {
            stream: dropped[stream] - self._passed[stream]
            for stream in STREAMS
            if self.takes(stream) and dropped[stream] > self._passed[stream]
        }
        if not lost:
            self.offset, self._passed = oldest, dropped
        return lost

    def pieces(self, end: int) -> Iterator[tuple[str, bytes]]:
        """The output from :attr:`offset` up to the absolute ``end`` (where
        a live piece ended: the head, say), as ``(stream, data)`` pieces of
        the streams it takes, split as the class says; each moved past
        before it is given, so a caller that stops taking them (its
        client's connection is full) resumes after the last it took. Read
        out of the ring ``read_batch`` bytes at a time (:data:`READ_BATCH`):
        a reader that stops early costs one batch."""
        want = self._read_batch
        while self.offset < end:
            before = self.offset
            limit = min(end - self.offset, want)
            for stream, data, run_end in self.retained.read(self.offset, limit):
                whole = self.offset + len(data) in (run_end, end)
                yield from self._run_pieces(stream, data, whole)
                if not whole:
                    break  # (the batch's last run anyway)
            # A line of a buffer or more that the batch cut before any
            # piece of it could end: read it whole (the ring bounds it).
            want = self._read_batch if self.offset > before else end - self.offset

    def _run_pieces(
        self, stream: str, data: bytes, whole: bool
    ) -> Iterator[tuple[str, bytes]]:
        """The pieces of ``data``, the next ``stream`` bytes (cut short of
        its run's end where not ``whole``)."""
        if not self.takes(stream):
            self.advance(stream, len(data))
            return
        left_out = min(max(self._starts[stream] - self.offset, 0), len(data))
        if left_out:
            self.advance(stream, left_out)
            data = data[left_out:]
        if not data:
            return
        step = max(self._bufsizes.get(stream, len(data)), 1)
        if not whole:
            data = data[: whole_pieces(data, step, stream in self._line_buffered)]
        for piece in line_chunks(data, step) if data else ():
            self.advance(stream, len(piece))
            yield stream, piece
