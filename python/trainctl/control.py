"""The worker's end of the elastic agent's control channel (``TRAINCTL_CONTROL_FD``).

The protocol is trainctl's own, defined once in Rust (``collective::control``); this is its
Python speaker, held to it by a conformance test that drives the real agent-side channel
against this module for every message, malformed frames included
(``crates/collective/tests/control_python.rs``).

A frame is a little-endian ``u32`` length and that many bytes (at most ``MAX_MESSAGE``); a
message is a kind byte and its fields: integers little-endian, strings a ``u32`` length and
UTF-8. Nothing read here is trusted: every length is bounded and every field checked, and a
message with bytes left over is refused.

Worker to agent: ``ready``, ``lost``, ``paused``, ``regrouped``, ``straggler``.
Agent to worker: ``Abort`` (leave the group now), ``Assign`` (the next round's worker
environment), ``Leave`` (this node goes: leave after the step under way, exit 143).
"""

from __future__ import annotations

import os
import queue
import socket
import struct
import threading
from typing import Callable, Iterable, Union

MAX_MESSAGE = 64 * 1024


class ControlError(Exception):
    """The channel broke, or the other end sent what the protocol does not allow."""


class Closed(ControlError):
    """The agent closed the channel (it restarts this node's workers)."""

    def __init__(self) -> None:
        super().__init__("the other end of the control channel closed it")


# --- worker to agent -----------------------------------------------------------------------


def _str(value: str) -> bytes:
    raw = value.encode("utf-8")
    return struct.pack("<I", len(raw)) + raw


def ready() -> bytes:
    """This worker regroups in place when its group changes."""
    return b"\x00"


def lost(assignments: int, step: int, reason: str) -> bytes:
    """A collective failed; the worker holds global step ``step`` and waits for a round."""
    return b"\x01" + struct.pack("<QQ", assignments, step) + _str(reason)


def paused(assignments: int, step: int) -> bytes:
    """The worker stopped after global step ``step`` for an assignment."""
    return b"\x02" + struct.pack("<QQ", assignments, step)


def regrouped(
    world_size_before: int,
    world_size: int,
    rank: int,
    step: int,
    steps_dropped: int,
    nbytes: int,
    seconds: float,
    received: bool,
    assignments: int,
) -> bytes:
    """What one regroup cost, as the worker saw it, and which of its ``assignments`` (its
    count of ``Assign`` messages) the new group is."""
    return b"\x03" + struct.pack(
        "<IIIQQQdBQ",
        world_size_before,
        world_size,
        rank,
        step,
        steps_dropped,
        nbytes,
        float(seconds),
        1 if received else 0,
        assignments,
    )


def straggler(slow: bool, report: str) -> bytes:
    """The ranks found this worker's node a straggler (``slow``), or no longer one."""
    return b"\x04" + (b"\x01" if slow else b"\x00") + _str(report)


def finished() -> bytes:
    """The job's training is over (every rank agreed on its last step): the agent neither
    regroups nor restarts this worker when a peer goes; it waits for it to exit."""
    return b"\x05"


# --- agent to worker -----------------------------------------------------------------------


class Abort:
    """Leave the group now, dropping the step in flight (a node of the group is gone)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Abort)

    def __repr__(self) -> str:
        return "Abort()"


class Leave:
    """This node goes: leave after the step under way and exit 143."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Leave)

    def __repr__(self) -> str:
        return "Leave()"


class Assign:
    """The next round's worker environment, as (name, value) pairs."""

    def __init__(self, env: Iterable[tuple[str, str]]):
        self.env = list(env)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Assign) and self.env == other.env

    def __repr__(self) -> str:
        return f"Assign({self.env!r})"


# What the agent sends.
Message = Union[Abort, Leave, Assign]


class _Decoder:
    def __init__(self, buf: bytes):
        self.buf = memoryview(buf)
        self.at = 0

    def take(self, n: int, what: str) -> memoryview:
        left = len(self.buf) - self.at
        if left < n:
            raise ControlError(f"malformed message: {what}: needs {n} bytes, {left} left")
        raw = self.buf[self.at : self.at + n]
        self.at += n
        return raw

    def u8(self, what: str) -> int:
        return self.take(1, what)[0]

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.take(4, what))[0]

    def string(self, what: str) -> str:
        raw = bytes(self.take(self.u32(what), what))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ControlError(f"malformed message: {what}: not valid UTF-8") from None

    def end(self, what: str) -> None:
        left = len(self.buf) - self.at
        if left:
            raise ControlError(f"malformed message: {what}: {left} unexpected trailing bytes")


def decode(buf: bytes) -> Message:
    """An agent's message from one frame's bytes."""
    d = _Decoder(buf)
    kind = d.u8("message kind")
    message: Message
    if kind == 2:
        message = Abort()
    elif kind == 3:
        message = Leave()
    elif kind == 1:
        n = d.u32("variables")
        # Each variable takes at least its two length prefixes.
        if n > len(buf) // 8:
            raise ControlError(f"malformed message: {n} variables in a message of {len(buf)} bytes")
        message = Assign((d.string("name"), d.string("value")) for _ in range(n))
    else:
        raise ControlError(f"malformed message: unknown message kind {kind}")
    d.end("agent message")
    return message


def frame(payload: bytes) -> bytes:
    """``payload`` as one frame."""
    if len(payload) > MAX_MESSAGE:
        raise ControlError(f"a message of {len(payload)} bytes is over the limit of {MAX_MESSAGE}")
    return struct.pack("<I", len(payload)) + payload


class Channel:
    """The worker's end: sends its messages; a thread reads the agent's into a queue, calling
    ``on_message`` with each as soon as it arrives (to break the group's links on an ``Abort``
    while the worker may be blocked inside a collective)."""

    def __init__(self, fd: int, on_message: Callable[[Message], object] | None = None):
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError as e:
            raise ControlError(f"descriptor {fd} is not the agent's control socket: {e}") from None
        if sock.family != socket.AF_UNIX:
            sock.close()
            raise ControlError(f"descriptor {fd} is not the agent's control socket (not a Unix socket)")
        sock.setblocking(True)
        self._sock = sock
        self._send_lock = threading.Lock()
        self.inbox: queue.Queue[Message | ControlError] = queue.Queue()
        self._on_message = on_message
        self._reader = threading.Thread(target=self._read, name="trainctl-control", daemon=True)
        self._reader.start()

    @classmethod
    def from_env(cls, on_message: Callable[[Message], object] | None = None) -> Channel | None:
        """The channel the agent handed this worker, or ``None`` when there is none."""
        fd = os.environ.get("TRAINCTL_CONTROL_FD")
        if fd is None:
            return None
        try:
            number = int(fd)
        except ValueError:
            raise ControlError(f"TRAINCTL_CONTROL_FD={fd!r} is not a descriptor number") from None
        return cls(number, on_message)

    def send(self, payload: bytes) -> None:
        with self._send_lock:
            try:
                self._sock.sendall(frame(payload))
            except (BrokenPipeError, ConnectionResetError):
                raise Closed() from None
            except OSError as e:
                raise ControlError(f"control channel: {e}") from None

    def _read(self) -> None:
        pending = b""
        while True:
            try:
                while len(pending) >= 4:
                    (n,) = struct.unpack("<I", pending[:4])
                    if n > MAX_MESSAGE:
                        raise ControlError(
                            f"control channel: a frame of {n} bytes is over the limit of {MAX_MESSAGE}"
                        )
                    if len(pending) < 4 + n:
                        break
                    message = decode(pending[4 : 4 + n])
                    pending = pending[4 + n :]
                    if self._on_message is not None:
                        self._on_message(message)
                    self.inbox.put(message)
                chunk = self._sock.recv(4096)
                if not chunk:
                    raise Closed()
                pending += chunk
            except ControlError as e:
                self.inbox.put(e)
                return
            except OSError as e:
                self.inbox.put(ControlError(f"control channel: {e}"))
                return

    def recv(self, timeout: float) -> Message | None:
        """The next message, waiting up to ``timeout`` seconds (0: only what has come);
        ``None`` when none came. A broken channel raises its error (every time)."""
        try:
            item = self.inbox.get(timeout=timeout) if timeout > 0 else self.inbox.get_nowait()
        except queue.Empty:
            return None
        if isinstance(item, ControlError):
            # Kept for whoever asks next: the channel stays broken.
            self.inbox.put(item)
            raise item
        return item

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
