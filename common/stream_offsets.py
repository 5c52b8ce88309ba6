"""Stream batches on the wire (``StreamSpan``): what a push trains, for exactly-once training from a stream.

Offsets are a partition's positions as unsigned 64-bit integers, increasing along the partition: a file's
record number, a Kafka offset, a Redis entry id ``ms-seq`` as ``ms << 20 | seq``
(``shardps.worker.stream.exactly_once``). Shards judge each push's span against what they hold
(``shardps.server.stream_positions``).
"""

from __future__ import annotations

from shardps.proto import shardps_pb2 as pb

#: Bytes of a partition's name.
MAX_PARTITION_BYTES = 256
#: Offsets are unsigned 64-bit integers.
MAX_OFFSET = 2 ** 64 - 1


def span(partition: str, after: int | None, last: int) -> pb.StreamSpan:
    """The ``StreamSpan`` of a batch of ``partition``'s events after offset ``after`` (None: from the partition's
    start) up to offset ``last``.

    Raises:
        ValueError: an empty partition name or one over 256 bytes, an offset that is not an int in
            [0, 2**64), or ``last`` not after ``after``; the message names the fix.
    """
    if not isinstance(partition, str) or not 0 < len(partition.encode()) <= MAX_PARTITION_BYTES:
        raise ValueError(f"a stream partition is named by 1 to {MAX_PARTITION_BYTES} bytes of text, got {partition!r}")
    for name, value in (("after", after), ("last", last)):
        if value is None and name == "after":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_OFFSET:
            raise ValueError(f"stream offset {name} must be an int in [0, 2**64), got {value!r}")
    if after is not None and not last > after:
        raise ValueError(f"a batch's last offset ({last}) must come after the offset before it ({after})")
    out = pb.StreamSpan(partition=partition, last=last)
    if after is not None:
        out.after = after
    return out
