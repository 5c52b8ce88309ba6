"""The helper process of a stream relay: one shard's gRPC streams, fed and drained over a Unix socket.

    python -m shardps.worker.session.relay_process FD

Started by :class:`~shardps.worker.session.relay.StreamRelay` with its end of
a socket pair as file descriptor ``FD``; the first message holds the shard's
address and the channel's settings. For each call the worker opens, this
process starts the stream-stream call on its own channel, feeds it the
request frames as they arrive and writes every answer frame back; the
call's end (or its gRPC status) follows. It imports neither torch nor the
worker's training code, and exits when the worker's end of the socket
closes (the worker exited, or closed the relay), cancelling its calls.
"""

from __future__ import annotations

import pickle
import queue
import socket
import sys
import threading

import grpc

from shardps.common.memory import retain_freed_memory
from shardps.worker.session.relay import (
    CANCEL, CONFIG, DONE, END, ERROR, FRAME, OPEN, read_message, send_message,
)

def _requests(q: queue.SimpleQueue):
    while (frame := q.get()) is not None:  # blocking wait for the worker's next frame
        yield frame


def _answer(sock: socket.socket, lock: threading.Lock, call_id: int, call, calls: dict) -> None:
    """Write every answer frame of ``call`` back, then DONE or ERROR with its status; then forget the call."""
    try:
        for frame in call:  # blocking reads from the shard
            send_message(sock, lock, FRAME, call_id, frame)
        send_message(sock, lock, DONE, call_id)
    except grpc.RpcError as exc:
        body = pickle.dumps((exc.code().name, exc.details() or ""))
        try:
            send_message(sock, lock, ERROR, call_id, body)
        except OSError:
            pass
    except OSError:  # the worker is gone: the main loop sees it too
        call.cancel()
    finally:
        calls.pop(call_id, None)


def serve(sock: socket.socket) -> None:
    """Run calls for the worker on ``sock`` until it closes."""
    kind, _, body = read_message(sock)
    if kind != CONFIG:
        raise SystemExit(f"relay_process: expected the settings first, got message kind {kind}")
    settings = pickle.loads(body)
    retain_freed_memory()  # chunk-sized buffers come and go: kept for reuse, as the worker and the shards do
    channel = settings["security"].channel(settings["address"], settings["options"])
    lock = threading.Lock()
    calls: dict[int, tuple[queue.SimpleQueue, object]] = {}
    try:
        while True:
            try:
                kind, call_id, body = read_message(sock)  # blocking read from the worker
            except (ConnectionError, OSError):
                return
            if kind == OPEN:
                method, timeout = pickle.loads(body)
                q: queue.SimpleQueue = queue.SimpleQueue()
                call = channel.stream_stream(method)(_requests(q), timeout=timeout)
                calls[call_id] = (q, call)
                threading.Thread(target=_answer, args=(sock, lock, call_id, call, calls), daemon=True).start()
            elif kind in (FRAME, END, CANCEL) and (entry := calls.get(call_id)) is not None:
                q, call = entry
                if kind == FRAME:
                    q.put(body)
                else:  # the requests end; a cancel ends the call first (the shard sees a cancel, not an end)
                    if kind == CANCEL:
                        call.cancel()
                    q.put(None)
    finally:
        for q, call in list(calls.values()):
            call.cancel()
            q.put(None)
        channel.close()


def main() -> None:
    fd = int(sys.argv[1])
    sock = socket.socket(fileno=fd)
    try:
        serve(sock)
    finally:
        sock.close()


if __name__ == "__main__":
    main()
