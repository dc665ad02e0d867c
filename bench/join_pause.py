#!/usr/bin/env python3
"""What a join and a loss cost the others, for docs/PERFORMANCE.md (issue 69).

On this machine's loopback (c10d, `--nnodes 2:3`, one worker per agent):
  - join: two agents train; a third starts. The survivors' pause is what their regroup line
    says (`paused X s`: from leaving their group at a step boundary to the new group's state
    in place), and the largest gap between two of their steps around the join (their metrics
    files). With `--warm-start auto` (the default) the joiner's workers run their start before
    it asks for a place; with `off`, after (the old way: the survivors wait for that start).
    The program: a trainctl.torch loop (the tests' fixtures/loop_patterns.py) whose start
    takes --starts seconds more (a slow import or model load), and the built-in trainer.
  - spare: three agents train and a fourth waits as a spare; one of the three is SIGKILLed:
    the time from the kill to the spare's first group (full size again), and the survivors'
    pause.
Prints one line per case and a Markdown table. Usage: bench/join_pause.py [--starts 0,5,20]
[--runs 1] [--trainctl PATH] [--python PATH] [--cases torch,builtin,spare].
"""
import argparse
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FIXTURE = os.path.join(ROOT, "crates", "trainctl", "tests", "cli", "fixtures", "loop_patterns.py")
PAUSED = re.compile(r"regrouped in place: world size (\d+) → (\d+).*paused ([0-9.]+) s")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Agent:
    """A `trainctl run` whose output lines arrive, timestamped, on a shared queue."""

    def __init__(self, name, cmd, cwd, env, lines):
        self.name = name
        self.lines = []
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._pump, args=(lines,), daemon=True).start()

    def _pump(self, lines):
        for line in self.proc.stdout:
            now = time.monotonic()
            self.lines.append((now, line.rstrip()))
            lines.put((self.name, now, line.rstrip()))

    def stop(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def wait_for(lines, pred, deadline, what):
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise SystemExit(f"timed out waiting for {what}")
        try:
            name, at, line = lines.get(timeout=left)
        except queue.Empty:
            continue
        if pred(name, line):
            return at, line


def steps_of(run_dir, rank):
    """The wall-clock times of rank `rank`'s step records (its metrics file)."""
    times = []
    path = os.path.join(run_dir, "metrics", f"rank-{rank}.jsonl")
    if os.path.isfile(path):
        with open(path) as f:
            for raw in f:
                try:
                    r = json.loads(raw)
                except ValueError:
                    continue
                if r.get("kind") == "step":
                    times.append(r["time"])
    return sorted(times)


def wait_for_steps(run_dir, n, deadline):
    """Until rank 0 has recorded `n` steps."""
    while len(steps_of(run_dir, 0)) < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {n} steps in {run_dir}")
        time.sleep(0.2)


def step_gap(run_dir, since):
    """The largest gap between two consecutive steps of the survivors (ranks 0 and 1: a regroup
    moves no survivor) from wall-clock time `since` on, from their metrics records' times."""
    gap = 0.0
    for rank in (0, 1):
        times = [t for t in steps_of(run_dir, rank) if t >= since]
        gap = max([gap] + [b - a for a, b in zip(times, times[1:])])
    return gap


def agent_cmd(args, port, run_id, program, warm):
    cmd = [
        args.trainctl, "run", "--nnodes", "2:3", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, "--job-token", "bench",
        "--health-check", "off", "--warm-start", "auto" if warm else "off",
    ]
    return cmd + program


def program_of(args, kind, start):
    if kind == "builtin":
        return ["train", "--data", "data", "--epochs", "1000", "--batch-size", "16",
                "--no-eval", "--out", "runs", "--threads", "1"]
    return ["--", args.python, FIXTURE, "--data", "data", "--out", "runs", "--epochs", "1000",
            "--slow-start", str(start), "--step-sleep", "0.02"]


def join_case(args, work, kind, start, warm):
    port = free_port()
    run_id = f"join-{kind}-{start}-{int(warm)}-{port}"
    lines = queue.Queue()
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    program = program_of(args, kind, start)
    agents = [Agent(f"a{i}", agent_cmd(args, port, run_id, program, warm), work, env, lines)
              for i in range(2)]
    try:
        deadline = time.monotonic() + 300
        wait_for_steps(os.path.join(work, "runs", run_id), 20, deadline)
        joined_at, joined_wall = time.monotonic(), time.time()
        joiner = Agent("j", agent_cmd(args, port, run_id, program, warm), work, env, lines)
        agents.append(joiner)
        pauses = []
        while len(pauses) < 2:
            at, line = wait_for(lines, lambda n, l: n != "j" and PAUSED.search(l), deadline,
                                "the survivors' regroup")
            pauses.append(float(PAUSED.search(line).group(3)))
        time.sleep(3)  # a few steps after the regroup, for the gap
        gap = step_gap(os.path.join(work, "runs", run_id), joined_wall)
        return {"case": f"{kind} join, start +{start} s, {'warm' if warm else 'cold'}",
                "paused": max(pauses), "step_gap": gap, "joiner_to_regroup": at - joined_at}
    finally:
        for a in agents:
            a.stop()


def spare_case(args, work, kind):
    port = free_port()
    run_id = f"spare-{kind}-{port}"
    lines = queue.Queue()
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    program = program_of(args, kind, 0)
    agents = [Agent(f"a{i}", agent_cmd(args, port, run_id, program, True), work, env, lines)
              for i in range(3)]
    try:
        deadline = time.monotonic() + 300
        wait_for_steps(os.path.join(work, "runs", run_id), 20, deadline)
        spare = Agent("s", agent_cmd(args, port, run_id, program, True), work, env, lines)
        agents.append(spare)
        wait_for(lines, lambda n, l: n == "s" and "trainctl run: a spare: " in l, deadline,
                 "the spare")
        # Not the store's host (the agent whose port won): the last of the three.
        victim = agents[2]
        killed = time.monotonic()
        victim.stop()
        # The spare's line and the survivors' regroup lines come in any order.
        at, pauses = None, []
        while at is None or len(pauses) < 2:
            when, line = wait_for(
                lines,
                lambda n, l: (n == "s" and "joined in place" in l)
                or (n in ("a0", "a1") and PAUSED.search(l)),
                deadline, "the spare's place and the survivors' regroup")
            if "joined in place" in line:
                at = when
            else:
                pauses.append(float(PAUSED.search(line).group(3)))
        return {"case": f"{kind}: a node killed, one spare", "loss_to_full": at - killed,
                "paused": max(pauses)}
    finally:
        for a in agents:
            a.stop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--starts", default="0,5,20")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--cases", default="torch,builtin,spare")
    ap.add_argument("--trainctl", default=os.path.join(ROOT, "target", "release", "trainctl"))
    ap.add_argument("--python", default=os.path.join(ROOT, "target", "pyenv", "bin", "python"))
    args = ap.parse_args()
    cases = args.cases.split(",")
    rows = []
    with tempfile.TemporaryDirectory() as work:
        subprocess.run([args.trainctl, "data", "synth", "--out", os.path.join(work, "data")],
                       check=True, stdout=subprocess.DEVNULL)
        for _ in range(args.runs):
            if "torch" in cases:
                for start in [int(s) for s in args.starts.split(",")]:
                    for warm in (True, False):
                        rows.append(join_case(args, work, "torch", start, warm))
                        print(rows[-1], flush=True)
            if "builtin" in cases:
                for warm in (True, False):
                    rows.append(join_case(args, work, "builtin", 0, warm))
                    print(rows[-1], flush=True)
            if "spare" in cases:
                for kind in ("builtin", "torch"):
                    rows.append(spare_case(args, work, kind))
                    print(rows[-1], flush=True)
    print("\n| case | survivors paused (their line) | largest step gap | join → regroup | loss → full size |")
    print("|---|--:|--:|--:|--:|")
    for r in rows:
        cell = lambda k: f"{r[k]:.2f} s" if r.get(k) else "—"  # noqa: E731
        print(f"| {r['case']} | {cell('paused')} | {cell('step_gap')} | {cell('joiner_to_regroup')} | {cell('loss_to_full')} |")


if __name__ == "__main__":
    sys.exit(main())
