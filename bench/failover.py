#!/usr/bin/env python3
"""Failover figures of the elastic agent, for docs/PERFORMANCE.md.

For each backend (c10d, etcd) and several runs, on this machine's loopback:
  - fresh: two agents started -> first training step done;
  - kill:  one of three agents killed (SIGKILL) mid-epoch -> survivors' round complete,
           workers started again (--regroup restart) or regrouped in place, first training
           step done at the new world size; and the steps trained again (the last global step
           before the restart or regroup minus the step training went on from, from the
           metrics files);
  - join:  a third agent started while two train -> first step done at world size 3 (the
           joiner's start to its first step), and the steps trained again.
Prints each run and the medians. Usage: bench/failover.py [--runs N] [--trainctl PATH]
[--model seed-cnn|resnet18] [--backends c10d,etcd] [--regroup in-process,restart]. The seed
CNN trains on generated CIFAR-10, a ResNet on a generated 64x64 image folder (tiny-imagenet's
layout), decoded into the cache.

With --program pytorch the agents run examples/pytorch/elastic_cifar.py (a PyTorch program
made elastic with trainctl.torch) under --python, and the mode `torchrun` (in --regroup) runs
the same program under PyTorch's own torchrun (c10d rendezvous, --max-restarts 3), which
restarts every worker on a change and resumes from the program's checkpoint (every
--checkpoint-every steps, the same for `restart`). Times then come from the metrics files
(torchrun prints no rounds): from the kill or the joiner's start to the first step recorded at
the new world size.
Needs `etcd` on PATH (scripts/test installs Debian's etcd-server).
"""
import json
import argparse
import os
import queue
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Agent:
    """A `trainctl run` whose output lines arrive, timestamped, on a shared queue."""

    def __init__(self, name, cmd, cwd, lines):
        self.name = name
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        threading.Thread(target=self._pump, args=(lines,), daemon=True).start()

    hosts_store = False

    def _pump(self, lines):
        for line in self.proc.stdout:
            if "(hosted by this agent)" in line:
                self.hosts_store = True
            lines.put((time.monotonic(), self.name, line.rstrip("\n")))

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def wait_for(lines, pred, timeout=120.0):
    """The time of the first line satisfying pred(name, line)."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no matching line")
        t, name, line = lines.get(timeout=left)
        if pred(name, line):
            return t


def is_step(line):
    return "] loss:" in line


def records(workdir, run_id):
    """Every rank's metrics records of the run, as dicts."""
    metrics = os.path.join(workdir, "runs", run_id, "metrics")
    for name in os.listdir(metrics):
        with open(os.path.join(metrics, name)) as f:
            for line in f:
                try:
                    yield json.loads(line)
                except ValueError:
                    continue  # a killed worker's last, partial line


def redone(workdir, run_id, at):
    """Steps trained again after the event at unix time `at`: the last global step any rank
    recorded before the workers were started again (or regrouped), minus the step training
    went on from."""
    steps, starts = [], []
    for r in records(workdir, run_id):
        if r.get("kind") == "step":
            steps.append((r["time"], r["step"]))
        elif r.get("kind") in ("start", "regroup") and r["time"] > at:
            starts.append((r["time"], r["step"]))
    if not starts:
        return 0
    restarted = min(t for t, _ in starts)
    before = max((step for t, step in steps if t < restarted), default=0)
    return before - min(step for _, step in starts)


def first_step(workdir, run_id, world_size, at):
    """Unix time of the first step record at `world_size` that ended after `at`, or None.
    (A step line on the launcher's output may be the old group's last: the step under way
    finishes before the workers leave their group, and its line can come after the new
    round's.)"""
    return min(
        (r["time"] for r in records(workdir, run_id)
         if r.get("kind") == "step" and r["world_size"] == world_size and r["time"] > at),
        default=None,
    )


def step_at(lines, workdir, run_id, world_size, at):
    """Seconds from unix time `at` to the end of the first step at `world_size`."""
    while True:
        wait_for(lines, lambda n, l: is_step(l))
        t = first_step(workdir, run_id, world_size, at)
        if t is not None:
            return t - at


def wait_for_record(workdir, run_id, pred, timeout=180.0):
    """Unix time of the first metrics record satisfying pred, polled."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            found = [r["time"] for r in records(workdir, run_id) if pred(r)]
        except FileNotFoundError:
            found = []
        if found:
            return min(found)
        time.sleep(0.05)
    raise TimeoutError("no matching record")


EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "pytorch", "elastic_cifar.py")


class Job:
    def __init__(self, trainctl, backend, workdir, etcd_url, model, regroup, python=None, every=10):
        self.trainctl, self.backend, self.workdir = trainctl, backend, workdir
        self.run = 0
        self.etcd_url = etcd_url
        self.model = model
        self.regroup = regroup
        self.python = python
        self.every = every

    def agent_cmd(self, run_id, endpoint):
        if self.python is None:
            return [
                self.trainctl, "run", "--nnodes", "2:3", "--nproc-per-node", "1",
                "--rdzv-backend", self.backend, "--rdzv-endpoint", endpoint,
                "--rdzv-id", run_id, "--job-token", "bench", "--regroup", self.regroup,
                "train", "--model", self.model, "--data", "data", "--out", "runs", "--epochs", "100",
                "--batch-size", "8", "--threads", "1", "--print-freq", "1", "--no-eval",
            ]
        program = [
            self.python, EXAMPLE, "--data", "data", "--out", "runs", "--epochs", "100",
            "--batch-size", "8", "--threads", "1", "--print-freq", "1",
            "--checkpoint-every", str(self.every),
        ]
        if self.regroup == "torchrun":
            return [
                self.python, "-m", "torch.distributed.run", "--nnodes", "2:3", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d" if self.backend == "c10d" else "etcd-v2",
                "--rdzv-endpoint", endpoint.replace("http://", ""), "--rdzv-id", run_id,
                "--max-restarts", "3",
            ] + program[1:]
        return [
            self.trainctl, "run", "--nnodes", "2:3", "--nproc-per-node", "1",
            "--rdzv-backend", self.backend, "--rdzv-endpoint", endpoint,
            "--rdzv-id", run_id, "--job-token", "bench", "--regroup", self.regroup,
            "--max-restarts", "3", "--",
        ] + program

    def start(self, n):
        self.run += 1
        run_id = f"{self.backend}-{os.getpid()}-{self.run}"
        endpoint = self.etcd_url if self.backend == "etcd" else f"127.0.0.1:{free_port()}"
        lines = queue.Queue()
        t0 = time.monotonic()
        agents = [
            Agent(f"a{i}", self.agent_cmd(run_id, endpoint), self.workdir, lines)
            for i in range(n)
        ]
        return agents, lines, t0, (run_id, endpoint)

    def fresh(self):
        agents, lines, t0, _ = self.start(2)
        try:
            return {"first step": wait_for(lines, lambda n, l: is_step(l)) - t0}
        finally:
            for a in agents:
                a.kill()

    def at_world_size(self, run_id, n, after=0.0):
        return wait_for_record(
            self.workdir, run_id,
            lambda r: r.get("kind") == "step" and r["world_size"] == n and r["time"] > after)

    def kill(self):
        agents, lines, _, (run_id, _) = self.start(3)
        if self.python is not None:
            return self.kill_by_records(agents, run_id)
        try:
            wait_for(lines, lambda n, l: "world size 3" in l and "round" in l)
            for _ in range(3):
                wait_for(lines, lambda n, l: is_step(l))
            # Kill an agent that does not host the c10d store (whichever bound its port first
            # does; losing it ends the job, which is another test's case).
            victim = next(a for a in reversed(agents) if not a.hosts_store)
            t0, at = time.monotonic(), time.time()
            victim.kill()
            t_round = wait_for(lines, lambda n, l: "of 2," in l and "round" in l)
            back = "regrouped in place" if self.regroup == "in-process" else "started rank"
            t_back = wait_for(lines, lambda n, l: back in l)
            return {
                "new round": t_round - t0,
                "regrouped" if self.regroup == "in-process" else "workers started": t_back - t0,
                "first step": step_at(lines, self.workdir, run_id, 2, at),
                "steps redone": redone(self.workdir, run_id, at),
            }
        finally:
            for a in agents:
                a.kill()

    def kill_by_records(self, agents, run_id):
        try:
            first = self.at_world_size(run_id, 3)
            wait_for_record(self.workdir, run_id,
                            lambda r: r.get("kind") == "step" and r["time"] > first + 2.0)
            # Not the agent whose port the store took (the first started, here).
            victim = next(a for a in reversed(agents) if not a.hosts_store)
            at = time.time()
            victim.kill()
            return {
                "first step": self.at_world_size(run_id, 2, at) - at,
                "steps redone": redone(self.workdir, run_id, at),
            }
        finally:
            for a in agents:
                a.kill()

    def join_by_records(self, agents, lines, run_id, endpoint):
        try:
            first = self.at_world_size(run_id, 2)
            wait_for_record(self.workdir, run_id,
                            lambda r: r.get("kind") == "step" and r["time"] > first + 2.0)
            at = time.time()
            agents.append(Agent("late", self.agent_cmd(run_id, endpoint), self.workdir, lines))
            return {
                "first step": self.at_world_size(run_id, 3, at) - at,
                "steps redone": redone(self.workdir, run_id, at),
            }
        finally:
            for a in agents:
                a.kill()

    def join(self):
        agents, lines, _, (run_id, endpoint) = self.start(2)
        if self.python is not None:
            return self.join_by_records(agents, lines, run_id, endpoint)
        try:
            wait_for(lines, lambda n, l: "world size 2" in l and "round" in l)
            for _ in range(3):
                wait_for(lines, lambda n, l: is_step(l))
            t0, at = time.monotonic(), time.time()
            agents.append(Agent("late", self.agent_cmd(run_id, endpoint), self.workdir, lines))
            t_round = wait_for(lines, lambda n, l: "of 3," in l and "round" in l)
            return {
                "new round": t_round - t0,
                "first step": step_at(lines, self.workdir, run_id, 3, at),
                "steps redone": redone(self.workdir, run_id, at),
            }
        finally:
            for a in agents:
                a.kill()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--trainctl", default="target/debug/trainctl")
    ap.add_argument("--model", default="seed-cnn")
    ap.add_argument("--backends", default="c10d,etcd")
    ap.add_argument("--regroup", default="in-process,restart")
    ap.add_argument("--scenarios", default="fresh,kill,join")
    ap.add_argument("--program", default="builtin", choices=["builtin", "pytorch"])
    ap.add_argument("--python", default="target/pyenv/bin/python",
                    help="with --program pytorch: a Python with torch and trainctl.torch")
    ap.add_argument("--checkpoint-every", type=int, default=10,
                    help="with --program pytorch: the program's checkpoints, for the restarts")
    args = ap.parse_args()
    python = os.path.abspath(args.python) if args.program == "pytorch" else None
    if python:
        # The checkout's package, whatever copy the Python has installed.
        os.environ["PYTHONPATH"] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python")
    trainctl = os.path.abspath(args.trainctl)
    work = tempfile.mkdtemp(prefix="failover-")
    etcd = None
    try:
        synth = [trainctl, "data", "synth", "--out", f"{work}/data", "--train", "960", "--test", "16"]
        if args.model != "seed-cnn":
            synth += ["--tiny", "--classes", "10", "--image-size", "64"]
        subprocess.run(synth, check=True, capture_output=True)
        etcd_bin = shutil.which("etcd")
        if etcd_bin is None:
            sys.exit("etcd not found: run scripts/test once (it installs etcd-server)")
        cport, pport = free_port(), free_port()
        etcd = subprocess.Popen(
            [etcd_bin, "--data-dir", f"{work}/etcd",
             "--listen-client-urls", f"http://127.0.0.1:{cport}",
             "--advertise-client-urls", f"http://127.0.0.1:{cport}",
             "--listen-peer-urls", f"http://127.0.0.1:{pport}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{pport}",
             "--initial-cluster", f"default=http://127.0.0.1:{pport}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(2)
        for backend in args.backends.split(","):
            for scenario in args.scenarios.split(","):
                # Runs alternate between the regroup modes, so that both see the same hour.
                modes = args.regroup.split(",")
                jobs = {m: Job(trainctl, backend, work, f"http://127.0.0.1:{cport}", args.model, m,
                               python, args.checkpoint_every)
                        for m in modes}
                runs = {m: [] for m in modes}
                for _ in range(args.runs):
                    for m in modes:
                        try:
                            runs[m].append(getattr(jobs[m], scenario)())
                        except TimeoutError:
                            # Never got there (torchrun's own agent fails some joins with a
                            # DistStoreError on its assigned ranks): counted, not timed.
                            runs[m].append(None)
                for m in modes:
                    done = [r for r in runs[m] if r is not None]
                    failed = len(runs[m]) - len(done)
                    if failed:
                        print(f"{backend:5} {m:10} {scenario:6} did not reach the new world size in "
                              f"{failed} of {len(runs[m])} runs", flush=True)
                    for key in (done[0] if done else {}):
                        values = [r[key] for r in done]
                        unit = "" if key == "steps redone" else " s"
                        print(f"{backend:5} {m:10} {scenario:6} {key:16} median {statistics.median(values):6.2f}{unit}"
                              f"  runs: {' '.join(f'{v:.2f}' for v in values)}", flush=True)
    finally:
        if etcd:
            etcd.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
