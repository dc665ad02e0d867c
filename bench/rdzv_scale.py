#!/usr/bin/env python3
"""Rendezvous at scale: N elastic agents on this machine, each running a trivial program.

For each backend (c10d, etcd) and each N in --sizes, on loopback:
  - form:   N agents started (`trainctl run --nnodes N/2:N --nproc-per-node 1 -- sleep 600`,
            all at once, or their starts spread over --spread seconds) -> every agent has
            printed a round of world size N; timed from the last agent's start;
  - rounds: how many rounds the job went through to get there (1 = it started once and never
            reopened; with --spread it grows by admitting late nodes in batches);
  - kill:   one agent (not the c10d store's host) SIGKILLed -> every survivor has printed a
            round of world size N-1;
  - store:  the store's CPU seconds while forming and while regrouping (etcd's process, or the
            c10d host agent's), and for etcd the requests it served per second and per agent
            (its grpc_server_handled_total) and the bytes it sent.
Prints one row per case and a Markdown table at the end.

Usage: bench/rdzv_scale.py [--sizes 16,64,128,256] [--backends c10d,etcd] [--spread SECONDS]
[--trainctl PATH] [--deadline SECONDS] [--rdzv-conf CONF] [--regroup restart|in-process]
Needs `etcd` on PATH for the etcd backend (scripts/test installs Debian's etcd-server) and a
release build (cargo build --release -p trainctl).
"""
import argparse
import os
import random
import selectors
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROUND = re.compile(r"round (\d+): node rank \d+ of \d+, first rank \d+, world size (\d+)")
REOPENED = "new rendezvous round"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid):
    """User + system CPU time of a live process, from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


class Agent:
    def __init__(self, cmd, env, reader, cwd=None):
        self.proc = subprocess.Popen(
            cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, start_new_session=True,
        )
        self.started = time.monotonic()
        self.world = 0  # world size of the latest round it printed
        self.round = -1
        self.hosts = False
        self.reopened = 0
        self.ready = None  # when it printed that its agent started
        self.rounds = []  # (time, round, world size) of each round it printed
        self.reopens = []  # when it printed that a new round opened
        self.regroups = []  # when it printed that its workers regrouped in place
        self.lines = []
        self.partial = b""
        reader.add(self)

    def feed(self, data, now):
        """Takes bytes read from the agent's stderr at `now`."""
        self.partial += data
        *complete, self.partial = self.partial.split(b"\n")
        for raw in complete:
            line = raw.decode(errors="replace")
            self.lines.append(line)
            m = ROUND.search(line)
            if m:
                self.round, self.world = int(m.group(1)), int(m.group(2))
                self.rounds.append((now, self.round, self.world))
            elif REOPENED in line:
                self.reopened += 1
                self.reopens.append(now)
            elif "regrouped in place" in line:
                self.regroups.append(now)
            if "elastic agent" in line and self.ready is None:
                self.ready = now
                self.hosts = "(hosted by this agent)" in line

    def stop(self, sig=signal.SIGKILL):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass


class Reader:
    """One thread reading every agent's stderr (one thread per agent would time the lines by
    when Python got around to them, not when they were written)."""

    def __init__(self):
        self.sel = selectors.DefaultSelector()
        self.lock = threading.Lock()
        self.done = False
        threading.Thread(target=self._run, daemon=True).start()

    def add(self, agent):
        os.set_blocking(agent.proc.stderr.fileno(), False)
        with self.lock:
            self.sel.register(agent.proc.stderr, selectors.EVENT_READ, agent)

    def _run(self):
        while not self.done:
            with self.lock:
                ready = self.sel.select(timeout=0) if self.sel.get_map() else []
            if not ready:
                time.sleep(0.002)
                continue
            now = time.monotonic()
            for key, _ in ready:
                try:
                    data = os.read(key.fileobj.fileno(), 65536)
                except BlockingIOError:
                    continue
                if data:
                    key.data.feed(data, now)
                else:
                    with self.lock:
                        self.sel.unregister(key.fileobj)


class Etcd:
    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="rdzv-scale-etcd-")
        self.port, peer = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        peer_url = f"http://127.0.0.1:{peer}"
        self.proc = subprocess.Popen(
            ["etcd", "--name", "bench", "--data-dir", f"{self.dir}/data",
             "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
             "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
             "--initial-cluster", f"bench={peer_url}"],
            stdout=subprocess.DEVNULL, stderr=open(f"{self.dir}/etcd.log", "w"),
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1) as r:
                    if b"true" in r.read():
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                sys.exit(f"etcd did not become healthy in 20 s; see {self.dir}/etcd.log")
            time.sleep(0.05)

    def counters(self):
        """(requests served, bytes sent to clients) so far, from etcd's metrics."""
        requests = sent = 0.0
        try:
            with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as r:
                for line in r.read().decode().splitlines():
                    if line.startswith("grpc_server_handled_total{"):
                        requests += float(line.rsplit(" ", 1)[1])
                    elif line.startswith("etcd_network_client_grpc_sent_bytes_total"):
                        sent += float(line.rsplit(" ", 1)[1])
        except OSError:
            pass
        return requests, sent

    def close(self):
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def wait_until(what, done, deadline):
    while time.monotonic() < deadline:
        if done():
            return time.monotonic()
        time.sleep(0.02)
    return None


def run_case(args, backend, n):
    etcd = Etcd() if backend == "etcd" else None
    port = etcd.port if etcd else free_port()
    run_id = f"scale-{backend}-{n}-{random.randrange(1 << 30):x}"
    cmd = [
        args.trainctl, "run", "--nnodes", f"{max(1, n // 2)}:{n}", "--nproc-per-node", "1",
        "--rdzv-backend", backend, "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", run_id, "--job-token", "bench",
        # The rendezvous is what is measured, not N health checks on the same cores.
        "--health-check", "off",
        "--regroup", args.regroup,
    ]
    if args.rdzv_conf:
        cmd += ["--rdzv-conf", args.rdzv_conf]
    if args.program == "train":
        cmd += ["train", "--model", "seed-cnn", "--data", "data", "--out", "runs",
                "--epochs", "100", "--batch-size", "8", "--threads", "1", "--no-eval",
                "--print-freq", "1000"]
    else:
        cmd += ["--", "sleep", "600"]
    env = dict(os.environ, RUST_LOG="warn")
    agents = []
    reader = Reader()
    row = {"backend": backend, "n": n}
    try:
        before = etcd.counters() if etcd else (0, 0)
        for i in range(n):
            agents.append(Agent(cmd, env, reader, cwd=args.work))
            if args.spread and i + 1 < n:
                time.sleep(args.spread / (n - 1))
        last_start = time.monotonic()
        host = None
        store_pid = etcd.proc.pid if etcd else None
        if not etcd:
            # The c10d store lives in the agent that won its port.
            found = wait_until("the store's host", lambda: any(a.hosts for a in agents),
                               last_start + 30)
            host = next((a for a in agents if a.hosts), None)
            store_pid = host.proc.pid if host else None
        cpu0 = cpu_seconds(store_pid) if store_pid else 0
        formed = wait_until(
            f"a round of {n}", lambda: all(a.world == n for a in agents),
            last_start + args.deadline,
        )
        row["form_s"] = None if formed is None else formed - last_start
        row["rounds"] = max(a.round for a in agents) + 1
        if args.timeline:
            ready = [a.ready for a in agents if a.ready]
            firsts = sorted(r for a in agents for r in a.rounds)
            print(f"  timeline from the last start: all agents up at "
                  f"{max(ready) - last_start:+.2f} s; first round {firsts[0][1]} (world size "
                  f"{firsts[0][2]}) at {firsts[0][0] - last_start:+.2f} s" if firsts and ready else "",
                  file=sys.stderr)
            by_round = {}
            for t, rnd, ws in firsts:
                by_round.setdefault((rnd, ws), []).append(t - last_start)
            for (rnd, ws), ts in sorted(by_round.items()):
                print(f"    round {rnd} world size {ws}: {len(ts)} agents, {min(ts):+.2f} .. {max(ts):+.2f} s",
                      file=sys.stderr)
        row["reopened"] = max(a.reopened for a in agents)
        if store_pid:
            row["store_cpu_form"] = cpu_seconds(store_pid) - cpu0
        row["agents_cpu_form"] = sum(cpu_seconds(a.proc.pid) for a in agents)
        after = etcd.counters() if etcd else (0, 0)
        if etcd and formed:
            took = formed - agents[0].started
            row["req_per_s"] = (after[0] - before[0]) / took
            row["req_per_agent_s"] = row["req_per_s"] / n
            row["mb_sent_form"] = (after[1] - before[1]) / 1e6
        # Steady state: a few seconds of a formed job, nothing changing.
        if formed:
            c0 = etcd.counters() if etcd else (0, 0)
            s0 = cpu_seconds(store_pid) if store_pid else 0
            time.sleep(args.idle)
            c1 = etcd.counters() if etcd else (0, 0)
            if store_pid:
                row["store_cpu_idle_frac"] = (cpu_seconds(store_pid) - s0) / args.idle
            if etcd:
                row["idle_req_per_agent_s"] = (c1[0] - c0[0]) / args.idle / n
        if formed:
            victim = random.choice([a for a in agents if a is not host])
            survivors = [a for a in agents if a is not victim]
            cpu1 = cpu_seconds(store_pid) if store_pid else 0
            killed = time.monotonic()
            victim.stop()
            regrouped = wait_until(
                f"a round of {n - 1}", lambda: all(a.world == n - 1 for a in survivors),
                killed + args.deadline,
            )
            row["regroup_s"] = None if regrouped is None else regrouped - killed
            if args.program == "train" and regrouped is not None:
                # The built-in trainer's workers regroup in place: until each survivor's
                # workers run again at the new world size.
                done = wait_until(
                    "the regroups", lambda: all(any(t > killed for t in a.regroups) for a in survivors),
                    killed + args.deadline,
                )
                row["in_place_s"] = None if done is None else done - killed
            seen = [t for a in survivors for t in a.reopens if t > killed]
            if args.timeline and seen:
                print(f"  after the kill: first agent told of a new round at +{min(seen) - killed:.2f} s,"
                      f" the last at +{max(seen) - killed:.2f} s", file=sys.stderr)
            if store_pid:
                row["store_cpu_regroup"] = cpu_seconds(store_pid) - cpu1
        if formed is None or row.get("regroup_s") is None:
            stuck = [a for a in agents if a.world != n]
            sample = stuck[0] if stuck else agents[0]
            print(f"  {backend} {n}: an agent's last lines:", file=sys.stderr)
            for line in sample.lines[-8:]:
                print(f"    {line}", file=sys.stderr)
    finally:
        # SIGTERM first: each agent stops its workers and removes its scratch folder (a
        # SIGKILL leaves one per agent in the temporary folder).
        for a in agents:
            a.stop(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for a in agents:
            try:
                a.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                a.stop()
                a.proc.wait()
        reader.done = True
        if etcd:
            etcd.close()
    return row


def fmt(v, spec="{:.2f}"):
    return "-" if v is None else spec.format(v)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="16,64,128,256")
    p.add_argument("--backends", default="c10d,etcd")
    p.add_argument("--spread", type=float, default=0.0,
                   help="spread the agents' starts over this many seconds")
    p.add_argument("--deadline", type=float, default=120.0)
    p.add_argument("--idle", type=float, default=3.0,
                   help="seconds of a formed job measured for the store's steady load")
    p.add_argument("--rdzv-conf", default="")
    p.add_argument("--program", choices=["sleep", "train"], default="sleep",
                   help="what each agent runs: `sleep 600`, or the built-in trainer (seed CNN on "
                        "a generated 960-image set, batch 8, 1 thread: for small N)")
    p.add_argument("--regroup", choices=["restart", "in-process"], default="in-process",
                   help="the agents' --regroup (trainctl run's default: in-process; `sleep` is no "
                        "Python program, so no agent holds late nodes for its workers' start)")
    p.add_argument("--timeline", action="store_true",
                   help="print when the agents came up and each round formed")
    p.add_argument("--trainctl", default=os.path.join(
        os.path.dirname(__file__), "..", "target", "release", "trainctl"))
    args = p.parse_args()
    if "etcd" in args.backends and not shutil.which("etcd"):
        sys.exit("etcd not found on PATH (Debian: apt-get install etcd-server)")
    args.work = tempfile.mkdtemp(prefix="rdzv-scale-")
    if args.program == "train":
        subprocess.run([os.path.abspath(args.trainctl), "data", "synth", "--out",
                        f"{args.work}/data", "--train", "960", "--test", "16"],
                       check=True, capture_output=True)
        args.trainctl = os.path.abspath(args.trainctl)
    rows = []
    for n in [int(s) for s in args.sizes.split(",")]:
        for backend in args.backends.split(","):
            row = run_case(args, backend, n)
            print(row, flush=True)
            rows.append(row)
    print()
    shutil.rmtree(args.work, ignore_errors=True)
    print("| backend | agents | spread | form | rounds | kill → new round | store CPU form / regroup | store CPU idle | etcd req/s per agent (forming / idle) |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|")
    for r in rows:
        fail = lambda k: fmt(r.get(k), "{:.2f} s") if r.get(k) is not None else "**none**"
        print(
            f"| {r['backend']} | {r['n']} | {args.spread:.0f} s | {fail('form_s')} | {r['rounds']} "
            f"| {fail('regroup_s') if 'form_s' in r and r['form_s'] else '-'}"
            f"{' (in place: ' + fail('in_place_s') + ')' if 'in_place_s' in r else ''} "
            f"| {fmt(r.get('store_cpu_form'))} / {fmt(r.get('store_cpu_regroup'))} s "
            f"| {fmt(r.get('store_cpu_idle_frac'), '{:.0%}')} "
            f"| {fmt(r.get('req_per_agent_s'), '{:.1f}')} / {fmt(r.get('idle_req_per_agent_s'), '{:.1f}')} |"
        )


if __name__ == "__main__":
    main()
