"""What the package-cost benchmarks (hf_cost.py, lightning_cost.py, pytorch_elastic_cost.py)
share: rounds of two runs of a script, alternated (ABBA: each kind runs first in every other
round, so that what the order costs cancels), each run's rank 0 printing
``STEPS_PER_S RATE``; each round's rate printed, then the medians and their ratio."""
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compare(rounds, kinds, command, names):
    """Runs ``command(kind, out)`` (a command line; ``out`` a fresh folder) for the two
    ``kinds`` over ``rounds``; prints the medians as ``names[kind]`` and the second kind's rate
    over the first's. Exits with the run's output when one fails."""
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    results = {kind: [] for kind in kinds}
    with tempfile.TemporaryDirectory() as out:
        for r in range(rounds):
            for kind in kinds if r % 2 == 0 else kinds[::-1]:
                done = subprocess.run(command(kind, os.path.join(out, f"{kind}-{r}")), env=env,
                                      capture_output=True, text=True)
                if done.returncode != 0 or "STEPS_PER_S " not in done.stdout:
                    sys.exit(f"{kind} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
                rate = float(done.stdout.split("STEPS_PER_S ")[1].split()[0])
                results[kind].append(rate)
                print(f"round {r + 1} {kind:8} {rate:7.2f} steps/s", flush=True)
    base, other = (statistics.median(results[k]) for k in kinds)
    print(f"median: {names[kinds[0]]} {base:.2f} steps/s, {names[kinds[1]]} {other:.2f} steps/s, "
          f"ratio {other / base:.3f}")
