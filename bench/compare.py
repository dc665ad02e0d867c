"""trainctl beside PyTorch, in one run on this machine.

1. One training step of each model (default: the seed CNN at 32 px, batch 128; torchvision's
   resnet18 and resnet50 at 64 px, batch 32), for each thread count: trainctl's release and
   dev builds and PyTorch, alternated, each in its own process; images/s (median over rounds),
   the ratio to PyTorch and each process's peak resident memory.
   With --precision bf16: trainctl's `--precision bf16` against PyTorch under
   torch.autocast("cpu", dtype=torch.bfloat16); with --precision fp32,bf16 both, and bf16
   trainctl also against fp32 PyTorch.
2. With --epoch N: the whole job, one epoch of N generated images: `trainctl run --standalone
   --nproc-per-node 2 train` against `torchrun --standalone --nproc-per-node 2
   bench/pytorch_ddp.py` on the same data, whole-process wall time.

Usage: bench/.venv/bin/python bench/compare.py [--threads 1,2] [--steps 5] [--warmup 5] [--rounds 2]
       [--models seed-cnn:32:128,resnet18:64:32] [--epoch 5120] [--baseline PATH_TO_AN_EARLIER_TRAINCTL]    (bench/run.sh builds both profiles and calls this)
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable


def peak_and_output(cmd, env=None):
    """Like measure, with the child's own peak RSS from wait4 (MiB)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT,
                            env={**os.environ, **(env or {})})
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed with exit code {proc.returncode}")
    return out.decode(), usage.ru_maxrss / 1024, time.perf_counter() - start


def last_json(text):
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


def step_table(threads, steps, rounds, baseline=None, model=("seed-cnn", 32, 128), precisions=("fp32",),
               dev=True, warmup=5):
    name_, size, batch = model
    shape = ["--model", name_, "--image-size", str(size), "--batch-size", str(batch)]
    # Every implementation runs the same untimed steps first (`trainctl bench --warmup`).
    timing = ["--steps", str(steps), "--warmup", str(warmup)]
    impls = {}
    for p in precisions:
        suffix = "" if precisions == ("fp32",) else f" {p}"
        prec = ["--precision", p]
        impls[f"trainctl release{suffix}"] = lambda t, prec=prec: ["target/release/trainctl", "bench", "--step-only", str(t)] + timing + shape + prec
        if dev:
            impls[f"trainctl dev{suffix}"] = lambda t, prec=prec: ["target/debug/trainctl", "bench", "--step-only", str(t)] + timing + shape + prec
        impls[f"pytorch{suffix}"] = lambda t, prec=prec: ([PYTHON, "bench/pytorch_step.py", "--threads", str(t)] + timing
                                                           + ["--allreduce-ranks", ""] + shape + prec)
    if baseline:
        # Another build (an earlier commit's release binary), alternated with the others.
        # A build from before `--warmup` runs its one warm-up step.
        help_text = subprocess.run([baseline, "bench", "--help"], capture_output=True, text=True).stdout
        base_timing = timing if "--warmup" in help_text else ["--steps", str(steps)]
        impls["baseline release"] = lambda t: [baseline, "bench", "--step-only", str(t)] + base_timing + shape
    results = {}
    for _ in range(rounds):
        for t in threads:
            for name, cmd in impls.items():
                out, peak, _ = peak_and_output(cmd(t))
                row = last_json(out)
                results.setdefault((name, t), []).append((row["images_per_s"], peak))
    print(f"\n{name_} at {size}×{size}, batch {batch}:\n")
    # Ratios round by round (each round's processes ran one after the other), then their median:
    # the machine's drift between rounds cancels out of each round's ratio.
    def ratio(name, torch_name, t):
        return statistics.median(a[0] / b[0] for a, b in zip(results[(name, t)], results[(torch_name, t)]))
    print("| threads | implementation | images/s | step (s) | peak memory (MiB) | ÷ PyTorch (same precision) | ÷ PyTorch fp32 |")
    print("|--:|---|--:|--:|--:|--:|--:|")
    summary = {}
    for t in threads:
        for name in impls:
            p = name.split()[-1] if name.split()[-1] in ("fp32", "bf16") else "fp32"
            own = "pytorch" if precisions == ("fp32",) else f"pytorch {p}"
            fp32 = "pytorch" if precisions == ("fp32",) else ("pytorch fp32" if "fp32" in precisions else None)
            ips = statistics.median(r[0] for r in results[(name, t)])
            peak = max(r[1] for r in results[(name, t)])
            summary[(name, t)] = ips
            against_fp32 = f"{ratio(name, fp32, t):.2f}×" if fp32 else ""
            print(f"| {t} | {name} | {ips:.1f} | {batch / ips:.3f} | {peak:.0f} | {ratio(name, own, t):.2f}× | {against_fp32} |")
    print("rounds:", json.dumps({f"{n} {t}": [round(r[0], 1) for r in v] for (n, t), v in results.items()}))
    return summary


def epoch_table(images, precisions=("fp32",), dev=True):
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "data")
        subprocess.run(["target/release/trainctl", "data", "synth", "--out", data, "--train", str(images),
                        "--test", "200"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        rows = []
        builds = [("trainctl release", "target/release/trainctl")]
        if dev:
            builds.append(("trainctl dev", "target/debug/trainctl"))
        for precision in precisions:
            for name, binary in builds:
                cmd = [binary, "run", "--standalone", "--nproc-per-node", "2", "train", "--data", data,
                       "--epochs", "1", "--no-eval", "--no-download", "--precision", precision,
                       "--out", os.path.join(tmp, name.replace(" ", "-") + precision)]
                start = time.perf_counter()
                subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                rows.append((f"{name} {precision}", time.perf_counter() - start))
            torchrun = os.path.join(os.path.dirname(PYTHON), "torchrun")
            cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "bench/pytorch_ddp.py", "--data", data,
                   "--epochs", "1", "--precision", precision]
            start = time.perf_counter()
            subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            rows.append((f"pytorch ddp (torchrun, gloo) {precision}", time.perf_counter() - start))
    torch_s = next(s for name, s in rows if name.startswith("pytorch") and name.endswith("fp32")) \
        if "fp32" in precisions else rows[-1][1]
    print(f"\n| one epoch of {images} images, 2 workers × batch 128 | whole-process wall (s) | images/s | PyTorch fp32 time ÷ this |")
    print("|---|--:|--:|--:|")
    for name, s in rows:
        print(f"| {name} | {s:.1f} | {images / s:.1f} | {torch_s / s:.2f}× |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", default="1,2")
    p.add_argument("--steps", type=int, default=5, help="timed steps per process; each figure is their median")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before them, the same for every implementation")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--epoch", type=int, default=0, help="images for the whole-job epoch (0: skip)")
    p.add_argument("--baseline", help="another trainctl binary (an earlier build) timed alongside")
    p.add_argument("--models", default="seed-cnn:32:128,resnet18:64:32,resnet50:64:32",
                   help="MODEL:IMAGE_SIZE:BATCH_SIZE,... whose step is timed")
    p.add_argument("--precision", default="fp32", help="fp32, bf16 or fp32,bf16")
    p.add_argument("--no-dev", action="store_true", help="leave the dev build out")
    a = p.parse_args()
    for spec in a.models.split(","):
        name, size, batch = spec.split(":")
        step_table([int(t) for t in a.threads.split(",")], a.steps, a.rounds, a.baseline,
                   (name, int(size), int(batch)), tuple(a.precision.split(",")), not a.no_dev, a.warmup)
    if a.epoch:
        epoch_table(a.epoch, tuple(a.precision.split(",")), not a.no_dev)


if __name__ == "__main__":
    main()
