"""This worker's process group: started from the environment a round gives it (or, with no
launcher, a group of one), broken at once when the agent says a node of it is gone, and torn
down before the next round's.

gloo has no abort of its own: an abort shuts down the sockets the group opened (found as the
descriptors that appeared while it started), not gloo's listener or the store's server side,
whose threads end the process on an error. NCCL uses PyTorch's ``_abort_process_group``. A
group still starting when its round ends (an ``Abort``, or the next round's ``Assign``
arriving meanwhile) is broken the same way, its store client included, plus ``INTERRUPT`` to
the main thread for a store connect loop that has no socket yet.
"""

from __future__ import annotations

import datetime
import fcntl
import gc
import os
import re
import signal
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from .. import control as ctl
from .. import regroup

# Interrupts a group start whose round is over (Elastic installs a handler that does nothing).
INTERRUPT = signal.SIGUSR2
# One try at connecting to a round's store (see Group._connect_store), in seconds.
STORE_TRY_S = 5.0


def say(message: str) -> None:
    print(f"trainctl.torch: {message}", file=sys.stderr, flush=True)


class Group:
    """The process group this worker trains in, and how to break it from another thread."""

    def __init__(self, backend: str, device: torch.device, launched: bool):
        self.backend = backend
        self.device = device
        # Under a launcher (RANK, WORLD_SIZE, MASTER_ADDR in the environment); otherwise a
        # group of one over an in-process store, so that the loop's collectives still work.
        self.launched = launched
        self.aborted = False
        # The links of the group now running: (descriptor, socket inode).
        self._links: list[tuple[int, str]] = []
        # The sockets open before the group now starting (None: no group starting); set under
        # _start_lock, which _keep_breaking holds while it breaks a start's links.
        self._starting: set[str] | None = None
        self._start_lock = threading.Lock()
        # Set (by the control channel's thread) when the round of the group now starting is
        # over before the group has started.
        self._round_over = False
        self._ifname_set = False
        # The group's collective timeout, in seconds: a collective that failed after waiting
        # this long timed out (a peer silent).
        self.timeout_s = _default_timeout(backend).total_seconds()
        self._main_thread: int | None = None
        if threading.current_thread() is threading.main_thread():
            # A signal of its own interrupts a group start blocked in a system call (the
            # store's connect loop) when its round is over: see on_message.
            signal.signal(INTERRUPT, lambda signum, frame: None)
            signal.siginterrupt(INTERRUPT, True)
            self._main_thread = threading.get_ident()

    # --- start and end ---------------------------------------------------------------------

    def begin(self) -> None:
        """The start of a group: from here an abort breaks what the start opens."""
        self._choose_interface()
        self._round_over = False
        with self._start_lock:
            self._starting = set(_sockets().values())

    def init(self) -> tuple[int, int]:
        """``init_process_group`` for the environment's round; returns (rank, world size)."""
        if not self.launched:
            hook = sys.excepthook
            dist.init_process_group(self.backend, store=dist.HashStore(), rank=0, world_size=1)
            sys.excepthook = hook
            return 0, 1
        timeout = os.environ.get("TRAINCTL_COLLECTIVE_TIMEOUT")
        kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=float(timeout))} if timeout else {}
        self.timeout_s = (kwargs.get("timeout") or _default_timeout(self.backend)).total_seconds()
        store = self._connect_store(kwargs.get("timeout") or _default_timeout(self.backend))
        if store is not None:
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            kwargs.update(store=store, rank=rank, world_size=world_size)
        if self.backend == "nccl":
            torch.cuda.set_device(self.device)
        _reset_group_names()
        # torch wraps sys.excepthook at every init_process_group to prefix "[rankN]" (the rank
        # of that group): after regroups, stale ranks nested. The launcher prefixes each line
        # with the worker's rank now; the hook is kept as it was.
        hook = sys.excepthook
        dist.init_process_group(self.backend, **kwargs)
        sys.excepthook = hook
        self.aborted = False
        return dist.get_rank(), dist.get_world_size()

    def established(self) -> None:
        """The group (and the DDP wrapper over it) started: its links are what the start
        opened."""
        with self._start_lock:
            before = self._starting or set()
            self._links = [(fd, inode) for fd, inode in _sockets().items() if inode not in before]
            self._starting = None

    def teardown(self, drop_wrapper: Callable[[], None]) -> None:
        """The group's end. ``drop_wrapper`` lets go of the DDP wrapper first (its reducer holds
        the group and threads of its own; it may sit in a reference cycle, hence the
        collection)."""
        self._links = []
        with self._start_lock:
            self._starting = None
        drop_wrapper()
        gc.collect()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group is gone either way
                pass

    # --- breaking it -------------------------------------------------------------------------

    def on_message(self, message: Any) -> None:
        """The agent's messages as they arrive (the control channel's reader thread): an Abort
        breaks the group's links; an assignment while a group is still starting means that
        group's round is already over (a node of it went), so its start is broken too."""
        start = self._starting
        starting = start is not None
        if isinstance(message, ctl.Abort) or (isinstance(message, ctl.Assign) and starting):
            self.abort_links()
            if starting:
                # After the abort, so that the start's failure reads as the group's loss.
                self._round_over = True
            # A start may also wait where no socket is open yet (connecting to a store that
            # is gone, retrying): the signal makes that system call return, and the start
            # fail.
            if starting and self._main_thread is not None:
                signal.pthread_kill(self._main_thread, INTERRUPT)
            if starting:
                threading.Thread(target=self._keep_breaking, args=(start,), daemon=True).start()

    def _keep_breaking(self, start: set[str] | None) -> None:
        """A start whose round is over may open new links after the abort broke the first
        ones: torch's store client reconnects within its try, and a store that takes the
        connection and never answers (its host stopped, not gone) would hold it there for good.
        Until that start has given up, what it opens is broken too, every half second."""
        while True:
            time.sleep(0.5)
            with self._start_lock:
                if self._starting is not start:
                    return
                self.abort_links()

    def abort_links(self) -> None:
        """Breaks the group's links so a collective blocked on it fails now, not after the
        timeout. gloo: shut its sockets down (the ones the group opened); NCCL: abort the
        communicators, as PyTorch documents."""
        self.aborted = True
        if self.backend == "nccl":
            try:
                dist.distributed_c10d._abort_process_group()
            except Exception:  # noqa: BLE001 - older torch: the backend's own abort
                try:
                    # No group (None) fails here as any other error does.
                    dist.group.WORLD._get_backend(self.device).abort()  # type: ignore[union-attr]
                except Exception:  # noqa: BLE001
                    pass
            return
        store_port = int(os.environ.get("MASTER_PORT", "0") or 0)
        links = list(self._links)
        starting = self._starting
        if starting is not None:
            # A group still starting (its store's rendezvous, gloo's pairs): what it has opened
            # so far, its store client included, which is what a start waits on.
            links = [(fd, inode) for fd, inode in _sockets().items() if inode not in starting]
        for fd, inode in links:
            try:
                if os.readlink(f"/proc/self/fd/{fd}") != f"socket:[{inode}]":
                    continue
                s = socket.socket(fileno=os.dup(fd))
                try:
                    # Only the links to peers: gloo's listener and the store (their threads
                    # end the process on an error) are left to the group's teardown.
                    if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                        continue
                    if s.family not in (socket.AF_INET, socket.AF_INET6):
                        continue
                    # The store's server side is left alone; its clients only while starting.
                    if s.getsockname()[1] == store_port:
                        continue
                    if starting is None and s.getpeername()[1] == store_port:
                        continue
                    s.shutdown(socket.SHUT_RDWR)
                finally:
                    s.close()
            except OSError:
                pass

    def failure(self, e: BaseException, waited: float) -> regroup.Failure:
        """How ``e``, raised after ``waited`` seconds of a step, an evaluation or a group's
        start, involves this group, from what this package itself knows and never from the
        error's wording: the group aborted on the agent's word, or its round over while it
        started; an error torch types as distributed; a link of the group closed or gone; a
        wait past the group's timeout (a peer silent). Anything else is the program's own."""
        # After an abort, PyTorch's `_abort_process_group` has also removed the default group:
        # a collective then raises ValueError ("not initialized"), part of the same loss.
        if (self.aborted or self._round_over) and isinstance(e, (RuntimeError, ValueError)):
            return regroup.Failure.PEER_LOST
        dist_error = getattr(dist, "DistError", None)
        if dist_error is not None and isinstance(e, dist_error):
            return regroup.Failure.PEER_LOST
        if not isinstance(e, RuntimeError):
            return regroup.Failure.OTHER
        if self.links_broken():
            return regroup.Failure.PEER_LOST
        if waited >= self.timeout_s:
            return regroup.Failure.TIMED_OUT
        return regroup.Failure.OTHER

    def links_broken(self) -> bool:
        """Whether a link of the group is closed (the peer's end shut: end of stream, reset) or
        gone (gloo closed its descriptor after an error), as the socket itself says. A group
        still starting: the links it opened so far, those still open."""
        with self._start_lock:
            starting = self._starting
        if starting is not None:
            links = [(fd, inode) for fd, inode in _sockets().items() if inode not in starting]
        else:
            links = list(self._links)
        for fd, inode in links:
            try:
                if os.readlink(f"/proc/self/fd/{fd}") != f"socket:[{inode}]":
                    return True
            except OSError:
                return True
            if _closed(fd):
                return True
        return False

    # --- the round's store ---------------------------------------------------------------------

    def _connect_store(self, timeout: datetime.timedelta) -> Any:
        """Every rank but the store's host (rank 0, which init_process_group makes host it, as
        torchrun's env:// does) connects to the round's store itself: it waits until the store
        answers, then connects in tries of a few seconds, and gives up as soon as the round is
        over. torch's own connect retries through the interrupt on_message sends, and through
        a store gone meanwhile, until the whole timeout (20 s and more lost: long enough for
        the next round's store to give up on this rank in turn). Returns None on rank 0."""
        if os.environ.get("RANK", "0") == "0" or not os.environ.get("MASTER_ADDR"):
            return None
        host, port = os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", "0") or 0)
        world_size = int(os.environ["WORLD_SIZE"])
        deadline = time.monotonic() + timeout.total_seconds()
        one_try = datetime.timedelta(seconds=min(STORE_TRY_S, timeout.total_seconds()))
        while not self._round_over:
            try:
                socket.create_connection((host, port), timeout=0.5).close()
                store = dist.TCPStore(host, port, world_size, False, one_try)
            except (OSError, RuntimeError) as e:
                # Not answering yet, or gone between the probe and the connect (torch's
                # DistNetworkError is a RuntimeError).
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the round's store at {host}:{port} timed out after "
                        f"{timeout.total_seconds():g} s without answering (`trainctl run "
                        f"--collective-timeout` waits longer): {why(e)}"
                    ) from e
                time.sleep(0.1)
                continue
            store.set_timeout(timeout)
            # The prefix init_process_group gives only a store it made itself (rank 0's).
            return dist.PrefixStore("default_pg", store)
        raise RuntimeError(f"the round was over before its store at {host}:{port} answered")

    def _choose_interface(self) -> None:
        """gloo binds the address its host name resolves to, which another host may not reach
        (network namespaces, some containers): unless the user chose, the interface on the
        route to MASTER_ADDR."""
        if not self.launched or self.backend != "gloo":
            return
        if "GLOO_SOCKET_IFNAME" in os.environ and not self._ifname_set:
            return
        name = _route_interface(os.environ.get("MASTER_ADDR", "127.0.0.1"))
        if name:
            os.environ["GLOO_SOCKET_IFNAME"] = name
            self._ifname_set = True


def why(e: BaseException) -> str:
    """A collective's error said in trainctl's words: what happened to the link, and which
    backend said so ("the connection to 10.0.0.2:19867 closed (gloo)"). The exception's own
    text, with PyTorch's source paths, is `detail(e)`, for the records."""
    return describe(detail(e))


def detail(e: BaseException) -> str:
    """A collective's error in one line, as PyTorch raised it, without its boilerplate."""
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    return first.split(" This is typically caused by")[0].strip()


# What gloo's and PyTorch's messages say, in trainctl's words (a phrase, its meaning).
_SAID = (
    ("connection closed by peer", "the connection to {peer} closed"),
    ("connection reset by peer", "the connection to {peer} was reset"),
    ("connection refused", "{peer} refused the connection"),
    ("broken pipe", "the connection to {peer} broke"),
    ("timed out", "a collective timed out waiting for {peer}"),
    ("socket closed", "the connection to {peer} closed"),
)


def describe(text: str) -> str:
    """`text` (a collective's error) in trainctl's words, or as it is, less PyTorch's prefixes
    and source paths, when it says nothing known."""
    rest = text
    for prefix in ("Got the following error when running the callback:", "RuntimeError:", "DistBackendError:"):
        rest = rest.replace(prefix, "")
    backend = "gloo" if "gloo" in text else ("nccl" if "nccl" in text.lower() else "")
    rest = re.sub(r"\[[^\]]*\.(?:cc|cpp|h):\d+\]", "", rest).strip()
    found = re.search(r"\[?([0-9a-fA-F.:]+)\]?:(\d+)", rest)
    peer = f"{found.group(1)}:{found.group(2)}" if found else "a peer"
    lower = rest.lower()
    for phrase, said in _SAID:
        if phrase in lower:
            words = said.format(peer=peer)
            return f"{words} ({backend})" if backend else words
    return rest or text


def _reset_group_names() -> None:
    """PyTorch names a group by a per-process count of the groups created (its store keys carry
    the name), which `destroy_process_group` resets, but a start that failed half-way leaves
    counted: ranks whose starts failed differently would then wait for each other's keys under
    different names. Every group start begins from the same name, as a fresh process's does."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and hasattr(world, "group_count") and not dist.is_initialized():
        world.group_count = 0


def _default_timeout(backend: str) -> datetime.timedelta:
    """torch's own default for a group's timeout (30 min; NCCL's 10)."""
    try:
        return dist.distributed_c10d._get_default_timeout(backend)
    except AttributeError:  # another torch: the documented constant
        return dist.default_pg_timeout


def _closed(fd: int) -> bool:
    """Whether socket ``fd``'s peer has shut its end (a read would see the end of the stream)
    or the connection failed; a listener, a socket with data waiting or one idle is open."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return True
    try:
        if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return False
        if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            return True
        return s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        s.close()


def _sockets() -> dict[int, str]:
    """This process's socket descriptors: descriptor → inode."""
    found: dict[int, str] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found[int(name)] = target
    return {fd: t[len("socket:[") : -1] for fd, t in found.items()}


def _route_interface(host: str) -> str | None:
    """The name of the interface this host reaches ``host`` through, or ``None``."""
    try:
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            probe.connect((host, 9))
            ip = probe.getsockname()[0]
        finally:
            probe.close()
    except OSError:
        return None
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == ip:
                return name
    finally:
        s.close()
    return None
