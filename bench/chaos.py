#!/usr/bin/env python3
"""The random-fault soak: N runs of a 3-node elastic job on network-namespace hosts (the
built-in trainer and a ``trainctl.torch`` program, c10d and etcd alternating), each hit once by a
fault drawn at random, with a replacement node where a node went; every run must end with every
sample of every epoch trained exactly once and every node but the victim exiting 0. It runs the
ignored test ``elastic::chaos::chaos_soak`` (crates/trainctl/tests/cli/elastic/chaos.rs, where
the faults are) and tallies its ``CHAOS RESULT`` lines by fault, backend and program.

Needs root (network namespaces), etcd and a Python with torch, as scripts/test sets them up.

Usage: bench/chaos.py [--runs 100] [--seed N] [--report FILE]
A failed run is printed with its seed: TRAINCTL_CHAOS_SEED=SEED replays it in one of the
suite's runs (cargo test -p trainctl --test cli a_random_fault).
"""
import argparse
import collections
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--seed", type=int, help="the first run's seed (default: drawn)")
    ap.add_argument("--report", help="also write the tally (Markdown) here")
    args = ap.parse_args()
    env = dict(os.environ, TRAINCTL_CHAOS_RUNS=str(args.runs))
    if args.seed is not None:
        env["TRAINCTL_CHAOS_SEED"] = str(args.seed)
    python = os.path.join(ROOT, "target", "pyenv", "bin", "python")
    if "TRAINCTL_PYTHON" not in env and os.path.exists(python):
        env["TRAINCTL_PYTHON"] = python
    cmd = [
        "cargo", "test", "-p", "trainctl", "--test", "cli", "elastic::chaos::chaos_soak",
        "--", "--ignored", "--nocapture",
    ]
    print("+", " ".join(cmd), f"(TRAINCTL_CHAOS_RUNS={args.runs})", flush=True)
    results = []
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        for line in p.stdout:
            if line.startswith("CHAOS RESULT"):
                print(line.rstrip(), flush=True)
                results.append(parse(line))
        p.wait()
    report = tally(results, args.runs)
    print(report)
    if args.report:
        with open(args.report, "w") as f:
            f.write(report)
    sys.exit(0 if results and all(r["ok"] for r in results) and len(results) == args.runs else 1)


def parse(line):
    fields = dict(re.findall(r"(\w+)=(\S+)", line))
    fields["ok"] = line.rstrip().endswith(" ok")
    fields["why"] = "" if fields["ok"] else line.split(" FAILED ", 1)[-1].strip()
    return fields


def tally(results, asked):
    ok = sum(r["ok"] for r in results)
    lines = [f"{ok} of {len(results)} runs exact ({asked} asked)", ""]
    lines.append("| fault | backend | program | runs | exact |")
    lines.append("|---|---|---|---|---|")
    groups = collections.Counter()
    exact = collections.Counter()
    for r in results:
        key = (r.get("fault", "?"), r.get("backend", "?"), r.get("program", "?"))
        groups[key] += 1
        exact[key] += r["ok"]
    for key in sorted(groups):
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {groups[key]} | {exact[key]} |")
    failed = [r for r in results if not r["ok"]]
    if failed:
        lines.append("")
        lines.append("Failed runs (TRAINCTL_CHAOS_SEED replays one):")
        for r in failed:
            lines.append(f"- run {r.get('run')} seed {r.get('seed')} {r.get('backend')} {r.get('program')}: {r['why']}")
    seconds = [float(r["seconds"]) for r in results if "seconds" in r]
    if seconds:
        lines.append("")
        lines.append(f"{sum(seconds) / 60:.1f} minutes in all, {max(seconds):.0f} s the longest run")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
