"""``Elastic``: the training loop's state and its regroup in place (see the package's doc).

A group's start is the same collectives for a worker that has just started and one that
regroups (``init_process_group``, ``_sync``, the DDP wrapper's own), so both can be in the
same new group. ``_sync`` makes every rank's state the same: the lowest rank of those
furthest on streams model, optimizer, scheduler, sampler position and user state to the
others; when every rank holds the same step nothing travels; at a job's start rank 0's fresh
or resumed state goes to all.

Each step's flags (stop, pause, leave, the samples trained and their digest) ride the last
bucket of DDP's gradient all-reduce (``_comm_hook``), or, when that cannot carry them, an
all-reduce of their own (``_agree``); the optimizer steps after it: a step is applied on a rank
only once every rank agreed it is whole, so after a peer is lost the survivors hold the same
step or one step apart, and the furthest streams.
"""

import datetime
import gc
import io
import os
import signal
import socket
import struct
import sys
import threading
import time
import zlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .. import control as ctl
from .. import stragglers
from ..records import SCHEMA_VERSION, Metrics
from ..sampler import MASK, Shard, digest

# contract::exit: a worker that stopped or left at a step boundary, and one that lost a peer
# and could not go on in place.
EXIT_PREEMPTED = 143
EXIT_PEER_LOST = 75

VERSION = "0.1.0"

# Interrupts a group start whose round is over (Elastic installs a handler that does nothing).
INTERRUPT = signal.SIGUSR2
# One try at connecting to a round's store (see Elastic._connect_store), in seconds.
STORE_TRY_S = 5.0

_STOP = object()
_LEAVE = object()


def _say(message):
    print(f"trainctl.torch: {message}", file=sys.stderr, flush=True)


class Step:
    """One step inside ``with job.step() as step:``. Set ``step.loss`` (and ``step.correct``,
    the right predictions of this rank's batch) for the records and the loss lines."""

    def __init__(self, job):
        self.job = job
        self.loss = None
        self.correct = None

    def __enter__(self):
        self.job._enter_step(self)
        return self

    def __exit__(self, exc_type, exc, tb):
        return self.job._exit_step(self, exc)


class Elastic:
    """The state of a data-parallel training run that regroups in place.

    ``model`` (an ``nn.Module``, wrapped in DDP here as ``job.model``) and ``optimizer`` are
    required; ``scheduler`` and ``state`` (any object with ``state_dict``/``load_state_dict``,
    whose state holds tensors and plain values) travel with them to joiners and into the
    checkpoint. ``dataset_size`` and ``batch_size`` (per rank) define the epoch's steps; its
    order is ``DistributedSampler``'s (``torch.randperm`` seeded by ``seed`` + epoch).
    The run's files go to ``OUT/RUN_ID/`` as the built-in trainer's do: ``metrics/rank-N.jsonl``
    and ``checkpoint.pt`` (rank 0, every epoch and every ``checkpoint_every`` steps; read at a
    start that no rank can take from a peer). SIGTERM (the whole job stopped) finishes the step
    under way on every rank, checkpoints it and exits 143: the constructor installs that
    handler.
    """

    def __init__(
        self,
        model,
        optimizer,
        *,
        dataset_size,
        batch_size,
        seed=0,
        scheduler=None,
        state=None,
        out="runs",
        checkpoint=None,
        checkpoint_every=None,
        print_freq=0,
        backend=None,
        config=None,
        straggler_factor=1.5,
        straggler_window=5,
    ):
        if dataset_size <= 0 or batch_size <= 0:
            raise ValueError(
                f"dataset_size {dataset_size} and batch_size {batch_size}: both must be positive"
            )
        self.module = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.user_state = state
        self.dataset_size = int(dataset_size)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.checkpoint_every = checkpoint_every
        self.print_freq = print_freq
        self.config = dict(config or {})
        self.distributed = "WORLD_SIZE" in os.environ
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")
        self.run_dir = os.path.join(out, self.run_id)
        self.checkpoint_path = checkpoint or os.path.join(self.run_dir, "checkpoint.pt")
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.device = (
            torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            if self.backend == "nccl"
            else torch.device("cpu")
        )
        self.progress = {
            "epoch": 0,
            "position": 0,
            "global_step": 0,
            "samples_seen": 0,
            "epoch_digest": 0,
        }
        # A state this worker trained (or took whole from a peer), not a stream cut off.
        self.live = False
        self.stop_requested = False
        self._ddp = None
        self._links = []
        self._aborted = False
        self._generation = 0
        self._current = None
        self._pending = None
        self._assigned = None
        self._assignments = 0
        self._leaving = False
        self._order_cache = None
        # The sockets that were open before the group now starting (None: no group starting);
        # set under _start_lock, which _keep_breaking holds while it breaks a start's links.
        self._starting = None
        self._start_lock = threading.Lock()
        # Set (by the control channel's thread) when the round of the group now starting is
        # over before the group has started.
        self._round_over = False
        self._flags_out = None
        self._flags_in = None
        # The straggler watch (as the built-in trainer's; window 0: none) and the step's times.
        self._watch = (
            stragglers.Watch(straggler_factor, straggler_window) if straggler_window else None
        )
        self._last_exit = None
        self._step_started = None
        self._step_data_s = 0.0
        self._epoch_mark = None
        self._window = []
        self._metrics = None
        self._started = False
        self._gloo_ifname_set = False
        self._main_thread = None
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)
            # A signal of its own interrupts a group start blocked in a system call (the
            # store's connect loop) when its round is over: see _on_message.
            signal.signal(INTERRUPT, lambda signum, frame: None)
            signal.siginterrupt(INTERRUPT, True)
            self._main_thread = threading.get_ident()
        self.control = None
        if self.distributed:
            try:
                self.control = ctl.Channel.from_env(on_message=self._on_message)
                if self.control is not None:
                    self.control.send(ctl.ready())
            except ctl.ControlError as e:
                _say(f"the agent's control channel cannot be used: {e}; a change of group restarts this worker")
                self.control = None
        self._synced = self._start_group()

    # --- what the training loop uses ---------------------------------------------------------

    @property
    def model(self):
        """The model to call: wrapped in ``DistributedDataParallel`` (again after a regroup)."""
        return self._ddp if self._ddp is not None else self.module

    def epochs(self, n):
        """The epochs left of ``n`` (0-based), from where the run stands."""
        self.epochs_total = int(n)
        if not self._started:
            self._started = True
            self._write_start()
        while self.progress["epoch"] < self.epochs_total:
            yield self.progress["epoch"]

    def batches(self):
        """This rank's sample indices for each step of the epoch, re-sharded from the position
        all ranks agree on after a regroup. Train each inside ``with job.step():``."""
        epoch = self.progress["epoch"]
        if self._epoch_mark is None or self._epoch_mark[0] != epoch:
            done = -(-self.progress["position"] // (self.batch_size * self.world_size))
            self._epoch_mark = (epoch, time.monotonic(), self.progress["global_step"] - done)
        while True:
            shard = Shard(
                self._order(epoch), self.progress["position"], self.world_size, self.rank, self.batch_size
            )
            generation = self._generation
            regrouped = False
            for s in range(shard.steps):
                self._current = (shard, s)
                self._pending = True
                yield shard.batch(s)
                if self._pending:
                    raise RuntimeError(
                        "each batch from job.batches() must be trained inside `with job.step():`"
                    )
                if self._generation != generation or self.progress["epoch"] != epoch:
                    regrouped = True
                    break
            if self.progress["epoch"] != epoch:
                return
            if not regrouped:
                break
        self._end_epoch()

    def step(self):
        """The context of one step: the optimizer steps at its end once every rank agreed the
        step is whole; a lost peer drops it and the workers regroup in place."""
        return Step(self)

    def finish(self):
        """The run's end: every rank says where it ended (its weights' fingerprint), and the
        group and the channel are closed."""
        p = self.progress
        print(
            f"rank {self.rank} finished after {p['global_step']} steps; weights fingerprint "
            f"{self.fingerprint():08x} (world size {self.world_size}, {p['samples_seen']} samples trained in all)",
            flush=True,
        )
        # Every rank past its last collective before any tears the group down (a group torn
        # down under a peer's gloo thread can abort that process); the DDP wrapper goes first.
        if self.distributed and dist.is_initialized():
            try:
                dist.barrier()
            except Exception:  # noqa: BLE001 - at the end, a peer gone changes nothing
                pass
        self._teardown()
        if self.control is not None:
            self.control.close()
        if self._metrics is not None:
            self._metrics.close()

    def fingerprint(self):
        """A CRC32 of the model's parameters and buffers: equal on ranks that hold the same."""
        crc = 0
        for t in self.module.state_dict().values():
            crc = zlib.crc32(t.detach().cpu().contiguous().numpy().tobytes(), crc)
        return crc

    # --- one step ----------------------------------------------------------------------------

    def _enter_step(self, step):
        if self._current is None:
            raise RuntimeError("job.step() is for the batches of job.batches()")
        self._drain()
        step.started = time.monotonic()
        # Waiting for this batch: since the last step ended (the loop's own loading).
        step.data_s = step.started - self._last_exit if self._last_exit is not None else 0.0
        self._step_started, self._step_data_s = step.started, step.data_s
        shard, s = self._current
        step.flags = self._flags(shard.unpadded_batch(s))
        # For the gradient all-reduce's last bucket to carry (`_comm_hook`); unless it does
        # (no backward, gradients that are not float32), `_agree` reduces them on their own.
        self._flags_out = torch.tensor(step.flags, dtype=torch.float32, device=self.device)
        self._flags_in = None

    def _exit_step(self, step, exc):
        try:
            return self._end_step(step, exc)
        finally:
            self._last_exit = time.monotonic()

    def _end_step(self, step, exc):
        shard, s = self._current
        self._pending = False
        if exc is None:
            try:
                outcome = self._agree(step)
            except Exception as e:  # noqa: BLE001 - sorted below
                if self.control is not None and self._collective_error(e):
                    self._lost(e)
                    return False
                raise
            self._apply(step, shard, s, outcome)
            return False
        if self.control is not None and self._collective_error(exc):
            self._lost(exc)
            return True
        return False

    def _drain(self):
        """The agent's messages that came while training: an assignment (the next round, taken
        after the step all ranks pause at) or this node's leave."""
        if self.control is None:
            return
        while True:
            try:
                message = self.control.recv(0)
            except ctl.ControlError:
                # A broken channel shows when the worker next needs it.
                return
            if message is None:
                return
            self._take(message)

    def _take(self, message):
        if isinstance(message, ctl.Assign):
            self._assigned = message.env
            self._assignments += 1
        elif isinstance(message, ctl.Leave):
            self._leaving = True

    def _flags(self, trained):
        """This rank's part of the step's agreement: stop, pause, leave, whether rank 0 leaves,
        and the samples trained with their digest in eight 8-bit limbs (summed exactly in
        float32 by up to 65,536 ranks)."""
        d = digest(trained)
        return [
            int(self.stop_requested),
            int(self._assigned is not None or self._leaving),
            int(self._leaving),
            int(self._leaving and self.rank == 0),
            len(trained),
        ] + [(d >> (8 * k)) & 0xFF for k in range(8)]

    def _comm_hook(self, _state, bucket):
        """DDP's gradient all-reduce (averaged, as DDP's own), whose last bucket also carries
        the step's flags: the agreement costs no collective of its own."""
        t = bucket.buffer()
        n, world = t.numel(), dist.get_world_size()
        flags = self._flags_out
        if bucket.is_last() and flags is not None and t.dtype == torch.float32:
            self._flags_out = None
            joined = torch.cat([t, flags, self._time_slots(t.device)])
            fut = dist.all_reduce(joined, async_op=True).get_future()

            def split(fut):
                out = fut.value()[0]
                self._flags_in = out[n:].clone()
                return out[:n].div_(world)

            return fut.then(split)
        fut = dist.all_reduce(t, async_op=True).get_future()
        return fut.then(lambda fut: fut.value()[0].div_(world))

    def _agree(self, step):
        """The step's flags over all ranks: from the gradient all-reduce when it carried them,
        else by an all-reduce of their own."""
        t = self._flags_in
        self._flags_in = self._flags_out = None
        if t is None:
            t = torch.cat(
                [
                    torch.tensor(step.flags, dtype=torch.float32, device=self.device),
                    self._time_slots(self.device),
                ]
            )
            if self.distributed:
                dist.all_reduce(t)
        values = t.tolist()
        n = len(step.flags)
        v = [int(round(x)) for x in values[:n]]
        world = dist.get_world_size() if self.distributed else 1
        times = stragglers.unpack(values[n:], world) if len(values) == n + stragglers.SLOTS * world else []
        return {
            "times": times,
            "stop": v[0] > 0,
            "pause": v[1] > 0,
            "leaving": v[2],
            "rank0_leaving": v[3] > 0,
            "samples": v[4],
            "digest": sum(v[5 + k] << (8 * k) for k in range(8)) & MASK,
        }

    def _apply(self, step, shard, s, outcome):
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        p = self.progress
        p["global_step"] += 1
        p["position"] = shard.position_after(s + 1)
        p["samples_seen"] += outcome["samples"]
        p["epoch_digest"] = (p["epoch_digest"] + outcome["digest"]) & MASK
        times = outcome["times"]
        speeds = stragglers.relative_speeds(times) if times else []
        self._record_step(step, shard, s, speeds[self.rank] if self.rank < len(speeds) else None)
        if self._watch is not None and times:
            change = self._watch.step(times)
            if change is not None:
                self._straggler(change)
        if outcome["stop"]:
            # Rank 0 saves what all hold (the lowest rank that stays when rank 0's node goes).
            saver = outcome["leaving"] if outcome["rank0_leaving"] else 0
            if self.rank == saver:
                self._checkpoint(force=True)
            if self.distributed:
                dist.barrier()
            _say(f"rank {self.rank} stopped after step {p['global_step']} (SIGTERM); the checkpoint holds it")
            self._teardown()
            sys.exit(EXIT_PREEMPTED)
        if outcome["pause"]:
            if self._leaving:
                self._leave()
            saver = outcome["leaving"] if outcome["rank0_leaving"] else 0
            self._regroup("paused for a new round", saver=self.rank == saver, lost=False)
            return
        every = self.checkpoint_every
        if every and p["global_step"] % every == 0 and p["position"] < self.dataset_size:
            self._checkpoint()

    def _time_slots(self, device):
        """This rank's times before the all-reduce, in its own slots of the step's agreement."""
        world = dist.get_world_size() if self.distributed else 1
        started = self._step_started if self._step_started is not None else time.monotonic()
        v = stragglers.slots(
            self.rank,
            world,
            self._step_data_s,
            time.monotonic() - started,
            int(os.environ.get("GROUP_RANK", "0")),
        )
        return torch.tensor(v, dtype=torch.float32, device=device)

    def _straggler(self, change):
        """A straggler found or gone: rank 0 says so and records it; the straggler's own node
        (its local rank 0) tells its agent, which may evict it (``--stragglers evict``)."""
        p = self.progress
        if change[0] == "started":
            s = change[1]
            slow, node, text = True, s["node"], stragglers.started_text(s, self._watch.window)
            record = dict(s, slow=True)
        else:
            _, node, slowdown = change
            slow, text = False, stragglers.ended_text(node, slowdown)
            record = {"slow": False, "node": node, "ranks": [], "slowdown": slowdown or 0.0}
        if self.rank == 0:
            print(text, flush=True)
            self._metrics_file().write("straggler", rank=0, step=p["global_step"], **record)
        mine = node == int(os.environ.get("GROUP_RANK", "0"))
        if mine and os.environ.get("LOCAL_RANK", "0") == "0" and self.control is not None:
            try:
                self.control.send(ctl.straggler(slow, text))
            except ctl.ControlError:
                # A broken channel shows when the worker next needs it.
                pass

    def _record_step(self, step, shard, s, slowdown=None):
        p = self.progress
        now = time.monotonic()
        seconds = now - step.started
        iter_ = p["global_step"] - self._epoch_mark[2]
        steps_in_epoch = iter_ + shard.steps - (s + 1)
        loss = float(step.loss) if step.loss is not None else 0.0
        batch = len(shard.batch(s))
        images = batch * self.world_size
        correct = float(step.correct) if step.correct is not None else 0.0
        self._metrics_file().write(
            "step",
            rank=self.rank,
            world_size=self.world_size,
            restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            epoch=p["epoch"] + 1,
            step=p["global_step"],
            iter=iter_,
            steps_in_epoch=steps_in_epoch,
            loss=loss,
            accuracy=correct / max(batch, 1),
            lr=float(self.optimizer.param_groups[0].get("lr", 0.0)),
            images=images,
            images_per_sec=images / max(seconds, 1e-9),
            step_s=seconds,
            data_s=step.data_s,
            compute_s=seconds,
            allreduce_s=0.0,
            **({"slowdown": slowdown} if slowdown is not None else {}),
        )
        self._window.append((loss, images))
        if self.rank == 0 and self.print_freq and iter_ % self.print_freq == 0:
            mean = sum(x for x, _ in self._window) / len(self._window)
            elapsed = now - self._epoch_mark[1]
            print(
                f"[{p['epoch'] + 1}, {iter_:5d}] loss: {mean:.3f}  ({iter_}/{steps_in_epoch} steps, "
                f"{sum(n for _, n in self._window) / max(elapsed, 1e-9):.1f} images/s)",
                flush=True,
            )
            self._window = []

    def _end_epoch(self):
        p = self.progress
        epoch_digest = p["epoch_digest"]
        p["epoch"] += 1
        p["position"] = 0
        p["epoch_digest"] = 0
        self._checkpoint()
        seconds = time.monotonic() - self._epoch_mark[1]
        self._metrics_file().write(
            "epoch",
            rank=self.rank,
            epoch=p["epoch"],
            step=p["global_step"],
            seconds=seconds,
            samples_digest=f"{epoch_digest:016x}",
        )
        if self.rank == 0:
            print(f"epoch {p['epoch']} done in {seconds:.1f} s", flush=True)

    def _order(self, epoch):
        if self._order_cache is None or self._order_cache[0] != epoch:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            self._order_cache = (epoch, torch.randperm(self.dataset_size, generator=g).tolist())
        return self._order_cache[1]

    # --- the group ---------------------------------------------------------------------------

    def _start_group(self):
        """Joins the group the environment names (the job's first, or a round's), makes every
        rank's state the same and wraps the model."""
        if not self.distributed:
            return self._sync()
        self._choose_interface()
        before = _sockets()
        self._round_over = False
        # While the group starts, an abort breaks what it has opened so far (see _abort_links).
        with self._start_lock:
            self._starting = set(before.values())
        timeout = os.environ.get("TRAINCTL_COLLECTIVE_TIMEOUT")
        kwargs = {"timeout": datetime.timedelta(seconds=float(timeout))} if timeout else {}
        store = self._connect_store(kwargs.get("timeout") or _default_timeout(self.backend))
        if store is not None:
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            kwargs.update(store=store, rank=rank, world_size=world_size)
        if self.backend == "nccl":
            torch.cuda.set_device(self.device)
        _reset_group_names()
        dist.init_process_group(self.backend, **kwargs)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._aborted = False
        synced = self._sync()
        self._ddp = DistributedDataParallel(
            self.module, device_ids=[self.device.index] if self.backend == "nccl" else None
        )
        self._ddp.register_comm_hook(None, self._comm_hook)
        after = _sockets()
        self._links = [(fd, inode) for fd, inode in after.items() if inode not in set(before.values())]
        with self._start_lock:
            self._starting = None
        self._generation += 1
        return synced

    def _choose_interface(self):
        """gloo binds the address its host name resolves to, which another host may not reach
        (network namespaces, some containers): unless the user chose, the interface on the
        route to MASTER_ADDR."""
        if self.backend != "gloo" or ("GLOO_SOCKET_IFNAME" in os.environ and not self._gloo_ifname_set):
            return
        name = _route_interface(os.environ.get("MASTER_ADDR", "127.0.0.1"))
        if name:
            os.environ["GLOO_SOCKET_IFNAME"] = name
            self._gloo_ifname_set = True

    def _sync(self):
        held_mine = self.progress["global_step"] + 1 if self.live else 0
        if self.distributed:
            t = torch.tensor([held_mine], dtype=torch.int64, device=self.device)
            out = [torch.zeros_like(t) for _ in range(self.world_size)]
            dist.all_gather(out, t)
            held = [int(x.item()) for x in out]
        else:
            held = [held_mine]
        furthest = max(held)
        resumed = False
        if furthest == 0:
            source = 0
            if self.rank == 0:
                resumed = self._load_checkpoint()
        elif all(h == furthest for h in held):
            self.live = True
            return {"resumed": False, "received": False, "bytes": 0}
        else:
            source = held.index(furthest)
        if held[self.rank] != furthest:
            self.live = False
        nbytes = 0
        if self.distributed:
            nbytes, resumed = self._broadcast_state(source, resumed)
        self.live = True
        from_peer = furthest > 0
        return {
            "resumed": resumed,
            "received": from_peer and held[self.rank] != furthest,
            "bytes": nbytes if from_peer else 0,
        }

    def _broadcast_state(self, source, resumed):
        if self.rank == source:
            buf = io.BytesIO()
            torch.save(self._state(resumed), buf)
            blob = buf.getvalue()
            size = torch.tensor([len(blob)], dtype=torch.int64, device=self.device)
        else:
            size = torch.zeros(1, dtype=torch.int64, device=self.device)
        dist.broadcast(size, src=source)
        n = int(size.item())
        if self.rank == source:
            data = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(self.device)
        else:
            data = torch.empty(n, dtype=torch.uint8, device=self.device)
        dist.broadcast(data, src=source)
        if self.rank == source:
            return n, resumed
        state = torch.load(io.BytesIO(data.cpu().numpy().tobytes()), map_location="cpu", weights_only=True)
        self._load_state(state)
        return n, bool(state["resumed"])

    def _state(self, resumed):
        return {
            "format": "trainctl.torch/1",
            "resumed": bool(resumed),
            "progress": dict(self.progress),
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "user": self.user_state.state_dict() if self.user_state is not None else None,
        }

    def _load_state(self, state):
        self.progress = {k: int(v) for k, v in state["progress"].items()}
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.user_state is not None and state.get("user") is not None:
            self.user_state.load_state_dict(state["user"])

    def _teardown(self):
        self._links = []
        with self._start_lock:
            self._starting = None
        if self._ddp is not None:
            # The wrapper (its reducer holds the group and threads of its own) goes before the
            # group; it may sit in a reference cycle, hence the collection.
            self._ddp = None
            gc.collect()
        if self.distributed and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group is gone either way
                pass

    def _connect_store(self, timeout):
        """Every rank but the store's host (rank 0, which init_process_group makes host it, as
        torchrun's env:// does) connects to the round's store itself: it waits until the store
        answers, then connects in tries of a few seconds, and gives up as soon as the round is
        over. torch's own connect retries through the interrupt _on_message sends, and through
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
                        f"--collective-timeout` waits longer): {_why(e)}"
                    ) from e
                time.sleep(0.1)
                continue
            store.set_timeout(timeout)
            # The prefix init_process_group gives only a store it made itself (rank 0's).
            return dist.PrefixStore("default_pg", store)
        raise RuntimeError(f"the round was over before its store at {host}:{port} answered")

    def _on_message(self, message):
        """The agent's messages as they arrive (the control channel's reader thread): an Abort
        breaks the group's links; an assignment while a group is still starting means that
        group's round is already over (a node of it went), so its start is broken too."""
        start = self._starting
        starting = start is not None
        if isinstance(message, ctl.Abort) or (isinstance(message, ctl.Assign) and starting):
            self._abort_links()
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

    def _keep_breaking(self, start):
        """A start whose round is over may open new links after the abort broke the first
        ones: torch's store client reconnects within its try, and a store that takes the
        connection and never answers (its host stopped, not gone) would hold it there for good.
        Until that start has given up, what it opens is broken too, every half second."""
        while True:
            time.sleep(0.5)
            with self._start_lock:
                if self._starting is not start:
                    return
                self._abort_links()

    def _abort_links(self):
        """An Abort from the agent (a node of the group is gone): break the group's links so a
        collective blocked on it fails now, not after the timeout. gloo: shut its sockets down
        (the ones the group opened); NCCL: abort the communicators, as PyTorch documents."""
        self._aborted = True
        if self.backend == "nccl":
            try:
                dist.distributed_c10d._abort_process_group()
            except Exception:  # noqa: BLE001 - older torch: the backend's own abort
                try:
                    dist.group.WORLD._get_backend(self.device).abort()
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

    def _collective_error(self, e):
        dist_error = getattr(dist, "DistError", None)
        if dist_error is not None and isinstance(e, dist_error):
            return True
        # After an abort, PyTorch's `_abort_process_group` has also removed the default group:
        # a collective then raises ValueError ("not initialized"), part of the same loss.
        if self._aborted and isinstance(e, (RuntimeError, ValueError)):
            return True
        if not isinstance(e, RuntimeError):
            return False
        text = str(e)
        return any(
            k in text
            for k in ("gloo", "Gloo", "NCCL", "onnection", "imed out", "closed by peer", "Socket")
        )

    def _lost(self, e):
        self.optimizer.zero_grad(set_to_none=True)
        self._regroup(_why(e), saver=self.rank == 0, lost=True)

    def _regroup(self, reason, saver, lost):
        """Leaves the group and goes on in the next round's, with every rank's state the same.
        Joining can fail (another node lost meanwhile): the worker says so and waits for the
        round after."""
        left = time.monotonic()
        world_size_before = self.world_size
        step_left = self.progress["global_step"]
        self._teardown()
        why = reason
        if lost:
            reason = f"peer lost: {reason}"
        while True:
            nxt = self._next_round(why, lost)
            if nxt is _LEAVE:
                self._leave()
            if nxt is _STOP:
                if saver:
                    self._checkpoint(force=True)
                _say(f"rank {self.rank} stopped (SIGTERM) while waiting for the next round")
                sys.exit(EXIT_PREEMPTED)
            os.environ.update(dict(nxt))
            saver = os.environ.get("RANK") == "0"
            try:
                synced = self._start_group()
                break
            except Exception as e:  # noqa: BLE001 - a collective of the new group failed
                if not self._collective_error(e):
                    raise
                _say(f"rank {os.environ.get('RANK')}: the new group failed ({e}); waiting for the next round")
                self._teardown()
                why, lost = f"joining the new group: {_why(e)}", True
        seconds = time.monotonic() - left
        p = self.progress
        regrouped = {
            "world_size_before": world_size_before,
            "world_size": self.world_size,
            "rank": self.rank,
            "step": p["global_step"],
            "steps_dropped": max(step_left - p["global_step"], 0),
            "bytes": synced["bytes"],
            "received": synced["received"],
            "seconds": seconds,
        }
        # The file of this worker's rank in the new group.
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        self._metrics_file().write("regroup", reason=reason, **regrouped)
        try:
            self.control.send(
                ctl.regrouped(
                    regrouped["world_size_before"],
                    regrouped["world_size"],
                    regrouped["rank"],
                    regrouped["step"],
                    regrouped["steps_dropped"],
                    regrouped["bytes"],
                    regrouped["seconds"],
                    regrouped["received"],
                )
            )
        except ctl.ControlError:
            # The agent's report of the regroup; training goes on without it.
            pass

    def _next_round(self, why, lost):
        """Tells the agent why this worker left its group, then waits for the next round's
        environment, a stop, or the word that this node goes. A closed channel: the agent
        restarts this node's workers, so this one exits as a lost peer's would."""
        step = self.progress["global_step"]
        try:
            if lost:
                self.control.send(ctl.lost(self._assignments, step, why))
            else:
                self.control.send(ctl.paused(self._assignments, step))
            assigned, self._assigned = self._assigned, None
            while True:
                while True:
                    message = self.control.recv(0)
                    if message is None:
                        break
                    if isinstance(message, ctl.Assign):
                        assigned = message.env
                        self._assignments += 1
                    else:
                        self._take(message)
                if self._leaving:
                    return _LEAVE
                # An assignment in hand is joined even when a stop came too: the stop then rides
                # the new group's first step, and every rank stops together.
                if assigned is not None:
                    return assigned
                if self.stop_requested:
                    return _STOP
                message = self.control.recv(0.1)
                if message is None:
                    continue
                if isinstance(message, ctl.Assign):
                    assigned = message.env
                    self._assignments += 1
                else:
                    self._take(message)
        except ctl.ControlError as e:
            _say(f"{why}; the agent did not regroup this worker ({e})")
            sys.exit(EXIT_PEER_LOST)

    def _leave(self):
        _say(
            f"rank {self.rank} leaves the job after step {self.progress['global_step']}: its node was asked to go"
        )
        self._teardown()
        sys.exit(EXIT_PREEMPTED)

    def _on_sigterm(self, signum, frame):
        self.stop_requested = True

    # --- files -------------------------------------------------------------------------------

    def _metrics_file(self):
        if self._metrics is None:
            self._metrics = Metrics(self.run_dir, self.rank)
        return self._metrics

    def _write_start(self):
        group = self.optimizer.param_groups[0]
        self._metrics_file().write(
            "start",
            v=SCHEMA_VERSION,
            rank=self.rank,
            world_size=self.world_size,
            restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            step=self.progress["global_step"],
            resumed=bool(self._synced["resumed"]),
            from_peer=bool(self._synced["received"]),
            config={
                "run_id": self.run_id,
                "epochs": self.epochs_total,
                "batch_size": self.batch_size,
                "learning_rate": float(group.get("lr", 0.0)),
                "momentum": float(group.get("momentum", 0.0) or 0.0),
                "weight_decay": float(group.get("weight_decay", 0.0) or 0.0),
                "seed": self.seed,
                "threads": torch.get_num_threads(),
                "checkpoint_every": self.checkpoint_every,
                "data": str(self.config.get("data", "")),
                "backend": f"pytorch-{self.backend}",
                "version": f"trainctl.torch {VERSION}, torch {torch.__version__}",
                "model": str(self.config.get("model", type(self.module).__name__)),
                "image_size": int(self.config.get("image_size", 0)),
            },
        )

    def _checkpoint(self, force=False):
        """Rank 0 (or, with ``force``, the rank a stop chose) writes the state all ranks hold,
        atomically: a temporary file, synced, then renamed; torch's format checksums each
        record."""
        if self.rank != 0 and not force:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.checkpoint_path)), exist_ok=True)
        tmp = f"{self.checkpoint_path}.tmp.{os.getpid()}"
        with open(tmp, "wb") as f:
            torch.save(self._state(False), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.checkpoint_path)
        dirfd = os.open(os.path.dirname(os.path.abspath(self.checkpoint_path)), os.O_RDONLY)
        try:
            os.fsync(dirfd)
        finally:
            os.close(dirfd)
        p = self.progress
        self._metrics_file().write(
            "checkpoint", rank=self.rank, step=p["global_step"], epoch=p["epoch"], position=p["position"]
        )

    def _load_checkpoint(self):
        if not os.path.isfile(self.checkpoint_path):
            return False
        try:
            state = torch.load(self.checkpoint_path, map_location="cpu", weights_only=True)
            if state.get("format") != "trainctl.torch/1":
                raise ValueError("not a trainctl.torch checkpoint")
        except Exception as e:  # noqa: BLE001 - say which file and why
            raise RuntimeError(
                f"{self.checkpoint_path}: cannot resume from it ({e}); move it away to start afresh"
            ) from None
        self._load_state(state)
        p = self.progress
        _say(f"resuming from {self.checkpoint_path}: epoch {p['epoch'] + 1}, step {p['global_step']}")
        return True


def _reset_group_names():
    """PyTorch names a group by a per-process count of the groups created (its store keys carry
    the name), which `destroy_process_group` resets, but a start that failed half-way leaves
    counted: ranks whose starts failed differently would then wait for each other's keys under
    different names. Every group start begins from the same name, as a fresh process's does."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and hasattr(world, "group_count") and not dist.is_initialized():
        world.group_count = 0


def _default_timeout(backend):
    """torch's own default for a group's timeout (30 min; NCCL's 10)."""
    try:
        return dist.distributed_c10d._get_default_timeout(backend)
    except AttributeError:  # another torch: the documented constant
        return dist.default_pg_timeout


def _why(e):
    """A collective's error in one line, without gloo's boilerplate."""
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    return first.split(" This is typically caused by")[0].strip()


def _sockets():
    """This process's socket descriptors: descriptor → inode."""
    found = {}
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


def _route_interface(host):
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
    import fcntl

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
