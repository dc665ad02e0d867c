#!/usr/bin/env python3
"""What looking for stragglers costs a step when nothing is slow.

Runs the same two-worker job (`trainctl run --nproc-per-node 2 train`, seed CNN, generated
CIFAR-format data) with the straggler watch off (`--straggler-window 0`) and on (the default,
5), alternated, and reports each run's median step time from the metrics (the first steps left
out) and the ratio on / off.

    python3 bench/straggler_cost.py [--trainctl target/release/trainctl] [--pairs 3]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def median_step(run_dir, skip):
    steps = []
    for name in os.listdir(os.path.join(run_dir, "metrics")):
        with open(os.path.join(run_dir, "metrics", name)) as f:
            for line in f:
                r = json.loads(line)
                if r.get("kind") == "step" and r["step"] > skip:
                    steps.append(r["step_s"])
    return statistics.median(steps), len(steps)


def run(trainctl, data, out, run_id, window, epochs, batch):
    cmd = [
        trainctl, "run", "--nproc-per-node", "2", "--rdzv-id", run_id, "train",
        "--data", data, "--out", out, "--epochs", str(epochs), "--batch-size", str(batch),
        "--threads", "1", "--no-eval", "--print-freq", "0",
        "--straggler-window", str(window),
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return median_step(os.path.join(out, run_id), skip=10)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trainctl", default="target/release/trainctl")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--images", type=int, default=4000)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "data")
        subprocess.run(
            [args.trainctl, "data", "synth", "--out", data, "--train", str(args.images),
             "--test", "100"],
            check=True, stdout=subprocess.DEVNULL,
        )
        results = {0: [], 5: []}
        for i in range(args.pairs):
            for window in (0, 5) if i % 2 == 0 else (5, 0):
                out = os.path.join(tmp, f"runs-{i}-{window}")
                step, n = run(args.trainctl, data, out, f"r{i}w{window}", window,
                              args.epochs, args.batch_size)
                results[window].append(step)
                print(f"pair {i}: watch {'on ' if window else 'off'} median step "
                      f"{step * 1e3:.2f} ms over {n} rank-steps", flush=True)
        off, on = statistics.median(results[0]), statistics.median(results[5])
        print(f"median of medians: off {off * 1e3:.2f} ms, on {on * 1e3:.2f} ms, "
              f"on/off {on / off:.3f}")


if __name__ == "__main__":
    sys.exit(main())
