"""A shard connection's push/pull streams carried by a helper process (``WireOptions(stream_processes=True)``).

gRPC's Python layer copies every message it sends once and every message it
receives three times (a bytes object per received slice, a bytearray, the
final bytes: grpc/grpc#42287), and does that and its per-message work
holding the worker's GIL, beside the training loop. With stream processes,
each :class:`~shardps.worker.session.client.ShardClient` starts one helper
process (``python -m shardps.worker.session.relay_process``) with a gRPC
channel of its own to its shard; the worker hands it the PushPull stream's
request frames over a Unix socket and reads the answer frames back from it.
The worker's share of the bytes is then one kernel copy each way, made with
the GIL released (a gradient chunk goes to the socket straight from its
tensor's memory, a pulled frame lands in one ``bytes``), besides the copy
of each pulled chunk into the model; the gRPC copies run in the helpers,
one per shard, on other cores (the separate communication process of
BytePS: Jiang et al., "A Unified Architecture for Accelerating Distributed
DNN Training in Heterogeneous GPU/CPU Clusters", OSDI 2020). A host whose
cores are all busy gains nothing: the helpers copy more in all.

The frames are the same bytes either way: the helper never decodes them,
and every check stays in the worker. A call behaves as a gRPC call does
(iterate it for the answer frames, ``cancel()``, ``done()``); its failure
is a :class:`RelayError` (a ``grpc.RpcError``) with the shard's status code,
or UNAVAILABLE when the helper process is gone, so the worker's error
handling and recovery are the same. A helper that exited is started again
for the next call.

Messages on the socket, both ways: ``kind`` (1 byte), call id (4 bytes),
body length (8 bytes, little-endian), body.
"""

from __future__ import annotations

import logging
import pickle
import queue
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator

import grpc

log = logging.getLogger(__name__)

_HEAD = struct.Struct("<BIQ")
#: worker -> helper: the channel's settings (call id 0), a call's start (body: pickled method and timeout),
#: one request frame, the end of a call's requests, a cancel
CONFIG, OPEN, FRAME, END, CANCEL = 1, 2, 3, 4, 5
#: helper -> worker: an answer frame (``FRAME``), the call ended OK, the call failed (body: pickled code name and
#: details)
DONE, ERROR = 6, 7
#: Largest message body either end accepts, bytes (a frame is at most gRPC's message limit).
MAX_BODY_BYTES = 1 << 31
#: Seconds a closing relay waits for its helper to exit before killing it.
CLOSE_SECONDS = 5.0
#: Seconds past a call's deadline that this process waits for the helper's answer (the helper's own gRPC call
#: ends at the deadline) before it fails the call itself: a helper that is stopped cannot hang the worker.
DEADLINE_GRACE_SECONDS = 5.0


def send_message(sock: socket.socket, lock: threading.Lock, kind: int, call: int,
                 body: bytes | tuple[bytes, ...] = b"") -> None:
    """Write one message whose body is ``body``, or its parts one after the other (a frame's prefix and
    payload: nothing joined); the GIL is released while the kernel copies them."""
    parts = [memoryview(part).cast("B") for part in (body if type(body) is tuple else (body,))]
    with lock:
        sock.sendall(_HEAD.pack(kind, call, sum(part.nbytes for part in parts)))
        for part in parts:
            if part.nbytes:
                sock.sendall(part)


def _exactly(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``sock`` as one ``bytes``, read straight into it (MSG_WAITALL); ConnectionError at EOF."""
    data = sock.recv(n, socket.MSG_WAITALL) if n else b""
    if len(data) < n:  # a signal cut the read short, or the other end is gone
        parts = [data]
        while (got := sum(map(len, parts))) < n:
            more = sock.recv(n - got, socket.MSG_WAITALL)
            if not more:
                raise ConnectionError(f"the stream relay's socket closed {n - got} bytes into a message")
            parts.append(more)
        data = b"".join(parts)
    return data


def read_message(sock: socket.socket) -> tuple[int, int, bytes]:
    """``(kind, call id, body)`` of the next message; ConnectionError once the other end closed the socket."""
    head = sock.recv(_HEAD.size, socket.MSG_WAITALL)
    if len(head) < _HEAD.size:
        if not head:
            raise ConnectionError("the stream relay's socket closed")
        head += _exactly(sock, _HEAD.size - len(head))
    kind, call, n = _HEAD.unpack(head)
    if n > MAX_BODY_BYTES:
        raise ConnectionError(f"the stream relay's socket announced a {n}-byte message (at most {MAX_BODY_BYTES})")
    return kind, call, _exactly(sock, n)


class RelayError(grpc.RpcError):
    """A relayed call failed: ``code()`` is the ``grpc.StatusCode`` and ``details()`` the message, as a gRPC call's."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class RelayCall:
    """One relayed stream: iterate it for the answer frames (``bytes``); ``cancel()``; ``done()``.

    Iteration raises :class:`RelayError` when the call failed (CANCELLED after ``cancel()``, UNKNOWN when the
    request iterator raised, UNAVAILABLE when the helper process exited, DEADLINE_EXCEEDED when no answer came
    by the deadline plus :data:`DEADLINE_GRACE_SECONDS`).
    """

    def __init__(self, relay: "StreamRelay", call_id: int, timeout: float) -> None:
        self.relay, self.id = relay, call_id
        self.deadline = time.monotonic() + timeout + DEADLINE_GRACE_SECONDS
        self.answers: queue.SimpleQueue = queue.SimpleQueue()
        self.ended = threading.Event()
        self.error: RelayError | None = None
        self.lock = threading.Lock()

    def finish(self, error: RelayError | None) -> bool:
        """Set the call's outcome (None: OK); the first one counts (True: this one did)."""
        with self.lock:
            if self.ended.is_set():
                return False
            self.error = error
            self.ended.set()
        self.answers.put(None)
        return True

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        try:  # blocking wait for the helper, bounded by the call's deadline
            frame = self.answers.get(timeout=max(0.0, self.deadline - time.monotonic()))
        except queue.Empty:
            if self.cancel_with(RelayError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                           f"the stream process of shard {self.relay.address} gave no answer by "
                                           "the call's deadline")):
                raise self.error from None
            frame = self.answers.get()  # ended meanwhile: its outcome is queued
        if frame is None:
            self.answers.put(None)  # iterating again after the end ends again
            if self.error is not None:
                raise self.error
            raise StopIteration
        return frame

    def cancel(self) -> bool:
        """Cancel the call (its iteration raises CANCELLED); False if it had ended."""
        return self.cancel_with(RelayError(grpc.StatusCode.CANCELLED, "Locally cancelled by application!"))

    def cancel_with(self, error: RelayError) -> bool:
        """End the call here with ``error`` and tell the helper to cancel it; False if it had ended."""
        if not self.finish(error):
            return False
        self.relay.send(CANCEL, self.id)
        return True

    def done(self) -> bool:
        return self.ended.is_set()


class StreamRelay:
    """The helper process of one shard connection and the calls it carries; see the module docstring.

    Args:
        address: the shard's ``host:port``.
        settings: what the helper's channel needs: ``{"security": ChannelSecurity, "options": [gRPC channel
            options]}`` (pickled to the helper over the socket).

    Raises:
        OSError: the helper process could not be started.
    """

    def __init__(self, address: str, settings: dict) -> None:
        self.address, self.settings = address, settings
        self.lock = threading.Lock()  # the socket's writers
        self.state = threading.Lock()  # calls, ids, the process
        self.calls: dict[int, RelayCall] = {}
        self.next_id = 1
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.closed = False

    def _start(self) -> None:
        """Start the helper (under ``self.state``) and the thread that reads its messages."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "shardps.worker.session.relay_process", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.sock = ours
        send_message(ours, self.lock, CONFIG, 0, pickle.dumps({"address": self.address, **self.settings}))
        threading.Thread(target=self._read, args=(ours, self.proc), daemon=True,
                         name=f"shardps-relay-{self.address}").start()

    def _read(self, sock: socket.socket, proc: subprocess.Popen) -> None:
        """Route the helper's messages to their calls until its socket closes; then fail what is still open."""
        try:
            while True:
                kind, call_id, body = read_message(sock)  # blocking read from the helper
                call = self.calls.get(call_id)
                if call is None:
                    continue  # a call cancelled here, whose last messages were on their way
                if kind == FRAME:
                    if not call.ended.is_set():  # (a call ended here takes no more frames)
                        call.answers.put(body)
                elif kind in (DONE, ERROR):
                    with self.state:
                        self.calls.pop(call_id, None)
                    error = None
                    if kind == ERROR:
                        code, details = pickle.loads(body)
                        error = RelayError(grpc.StatusCode[code], details)
                    call.finish(error)
        except (ConnectionError, OSError):
            pass
        with self.state:
            orphans = [c for c in self.calls.values()] if self.sock is sock else []
            if self.sock is sock:
                self.calls.clear()
                self.sock = None
        try:
            code = proc.wait(1.0)  # a helper that died has its status by now; one that lives on is told by EOF
        except subprocess.TimeoutExpired:
            code = None
        for call in orphans:
            call.finish(RelayError(grpc.StatusCode.UNAVAILABLE,
                                   f"the stream process of shard {self.address} exited (status {code}) "
                                   "during the call"))
        if not self.closed:
            log.warning("stream process of shard %s ended (status %s); the next call starts another",
                        self.address, code)

    @property
    def pid(self) -> int | None:
        """The running helper's process id; None before the first call, or once it exited."""
        proc = self.proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def send(self, kind: int, call_id: int, body: bytes | tuple[bytes, ...] = b"") -> None:
        """Send one message to the helper; a helper that is gone fails the call through :meth:`_read`."""
        sock = self.sock
        if sock is None:
            return
        try:
            send_message(sock, self.lock, kind, call_id, body)
        except OSError:
            pass  # the reader sees the closed socket and fails the open calls

    def stream(self, method: str, frames: Iterable[bytes], timeout: float) -> RelayCall:
        """Start the stream-stream call ``method`` (its full path, ``"/shardps.v1.Shard/PushPull"``) with request
        frames ``frames``.

        A thread of this process iterates ``frames`` (``bytes``, or a frame's ``(prefix, payload)`` parts,
        written uncopied) and hands each frame to the helper before it takes the next, as gRPC's
        request-consumer thread would; an exception there fails the call with UNKNOWN.

        Raises:
            RuntimeError: the relay was closed.
        """
        with self.state:
            if self.closed:
                raise RuntimeError(f"the stream relay of shard {self.address} is closed")
            if self.sock is None or self.proc is None or self.proc.poll() is not None:
                self._start()
            call = RelayCall(self, self.next_id, timeout)
            self.next_id += 1
            self.calls[call.id] = call
        self.send(OPEN, call.id, pickle.dumps((method, timeout)))
        threading.Thread(target=self._requests, args=(call, frames), daemon=True,
                         name=f"shardps-relay-requests-{call.id}").start()
        return call

    def _requests(self, call: RelayCall, frames: Iterable[bytes]) -> None:
        try:
            for frame in frames:
                if call.done():
                    return
                self.send(FRAME, call.id, frame)
        except Exception as exc:  # as gRPC does when a request iterator raises
            log.exception("Exception iterating requests!")
            call.cancel_with(RelayError(grpc.StatusCode.UNKNOWN, f"Exception iterating requests! {exc!r}"))
            return
        self.send(END, call.id)

    def close(self) -> None:
        """Fail the open calls with CANCELLED, stop the helper (killed after :data:`CLOSE_SECONDS`)."""
        with self.state:
            self.closed = True
            calls, self.calls = list(self.calls.values()), {}
            sock, proc, self.sock = self.sock, self.proc, None
        for call in calls:
            call.finish(RelayError(grpc.StatusCode.CANCELLED, "the shard client was closed"))
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # the helper reads EOF and exits
            except OSError:
                pass
            sock.close()
        if proc is not None:
            try:
                proc.wait(CLOSE_SECONDS)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
