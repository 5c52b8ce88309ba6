"""``FileReplay``: a file of timestamped records replayed as an event stream (MovieLens' ``u.data``, a log).

Each line is one record of ``columns`` separated by ``delimiter`` (MovieLens-100K's ``u.data``: ``user item
rating timestamp``, tab-separated); the column ``time_column`` is the event time in seconds. A replay
requires the records in event-time order (a stream's order) and refuses a line whose time goes back,
naming it; ``sort=True`` reads the whole file and orders it by time first (stably: ties keep the file's
order), for small files such as ``u.data``, which is not ordered. The offset of an event is its record's
number in that order (``"0"``, ``"1"``, ...), and ``start_after`` resumes after a committed one.
"""

from __future__ import annotations

import time
from pathlib import Path

from shardps.worker.stream.events import Event

__all__ = ["FileReplay"]


class FileReplay:
    """Records of a text file as events (:class:`~shardps.worker.stream.events.EventSource`).

    Args:
        path: the file. columns: the names of a line's columns, in order. time_column: the column holding
            the event time (seconds; int or float text). delimiter: between columns (None: any whitespace).
        sort: order the records by event time first (reads the whole file).
        start_after: the committed offset to resume after (None: from the first record).
        speedup: None: hand records out as fast as they are read; a factor: pace them at ``speedup`` times
            the event clock (1.0: as they happened), for a live-like replay.
        partition: the replay's name as a stream partition (exactly-once training); default the file's name.

    Raises:
        FileNotFoundError: no such file. ValueError (from :meth:`read`): a line without as many columns,
            a time that is not a number, or (without ``sort``) a time before the previous record's.
    """

    def __init__(self, path: str | Path, columns: list[str], time_column: str, *, delimiter: str | None = "\t",
                 sort: bool = False, start_after: str | None = None, speedup: float | None = None,
                 partition: str | None = None) -> None:
        if time_column not in columns:
            raise ValueError(f"time_column {time_column!r} is not one of the columns {columns}")
        if speedup is not None and not speedup > 0:
            raise ValueError(f"speedup must be > 0 or None, got {speedup}")
        self.path, self.columns, self.time_column = Path(path), list(columns), time_column
        self.partition = partition or self.path.name  # its name for exactly-once training (exactly_once.py)
        self.delimiter, self.speedup = delimiter, speedup
        self._file = open(self.path, encoding="utf-8")  # noqa: SIM115 - closed by close()
        self._line = 0  # lines read from the file
        self._number = 0  # records handed out or skipped: the next record's offset
        self._last = float("-inf")
        self._sorted: list[tuple[float, int, dict]] | None = None
        if sort:
            records = [self._parse(line, k + 1) for k, line in enumerate(self._file) if line.strip()]
            self._sorted = sorted(((t, k, f) for k, (t, f) in enumerate(records)), key=lambda r: (r[0], r[1]))
        self._ended = False
        self._clock: tuple[float, float] | None = None  # (first event time, monotonic then) when paced
        self._skip_to(-1 if start_after is None else int(start_after))

    def _skip_to(self, after: int) -> None:
        while self._number <= after and self._next() is not None:
            pass

    @property
    def ended(self) -> bool:
        return self._ended

    def _parse(self, line: str, number: int) -> tuple[float, dict[str, str]]:
        values = line.rstrip("\n").split(self.delimiter)
        if len(values) != len(self.columns):
            raise ValueError(f"{self.path}:{number}: {len(values)} columns, expected {len(self.columns)} "
                             f"({', '.join(self.columns)})")
        fields = dict(zip(self.columns, values))
        try:
            t = float(fields.pop(self.time_column))
        except ValueError:
            raise ValueError(f"{self.path}:{number}: the time {values[self.columns.index(self.time_column)]!r} "
                             "is not a number") from None
        return t, fields

    def _next(self) -> Event | None:
        """The next record as an event (None at the end)."""
        if self._sorted is not None:
            if self._number >= len(self._sorted):
                self._ended = True
                return None
            t, _, fields = self._sorted[self._number]
        else:
            line = ""
            while not line.strip():
                line = self._file.readline()
                self._line += 1
                if not line:
                    self._ended = True
                    return None
            t, fields = self._parse(line, self._line)
            if t < self._last:
                raise ValueError(f"{self.path}:{self._line}: time {t} is before the previous record's {self._last}: "
                                 "a replay needs the records in time order (sort the file, or sort=True)")
        self._last = t
        event = Event(str(self._number), t, dict(fields))
        self._number += 1
        return event

    def read(self, max_events: int, timeout: float) -> list[Event]:
        """Up to ``max_events`` next records (paced by ``speedup``: waits at most ``timeout`` seconds for the
        first due one); ``[]`` at the end."""
        out: list[Event] = []
        deadline = time.monotonic() + timeout
        while len(out) < max_events:
            event = self._peek()
            if event is None:
                break
            if self.speedup is not None:
                if self._clock is None:
                    self._clock = (event.time, time.monotonic())
                due = self._clock[1] + (event.time - self._clock[0]) / self.speedup
                if due > time.monotonic():
                    if out or due > deadline:
                        break
                    time.sleep(max(0.0, due - time.monotonic()))  # (the clock moved on since the test)
            out.append(event)
            self._held = None
        return out

    _held: Event | None = None

    def _peek(self) -> Event | None:
        if self._held is None:
            self._held = self._next()
        return self._held

    def position(self, event: Event) -> int:
        """``event``'s offset as an int (its record number), for exactly-once training."""
        return int(event.offset)

    def seek(self, after: int | None) -> None:
        """Read next the records after offset ``after`` (None: from the first), pacing anew."""
        if self._sorted is None:
            self._file.seek(0)
            self._line, self._last = 0, float("-inf")
        self._number, self._held, self._ended, self._clock = 0, None, False, None
        self._skip_to(-1 if after is None else after)

    def commit(self, offset: str) -> None:
        """Nothing to tell a file: the caller keeps the committed offset and passes it as ``start_after``."""

    def close(self) -> None:
        self._file.close()
