#!/usr/bin/env bash
# Side-by-side figures for docs/PERFORMANCE.md: trainctl and PyTorch, same machine, same run.
# Installs PyTorch from PyPI into bench/.venv on first use; builds trainctl's release and dev
# profiles (the dev profile is what `cargo run` and the tests use).
#   bench/run.sh [--threads 1,2] [--steps 5] [--warmup 5] [--rounds 2] [--epoch 5120]
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x bench/.venv/bin/python ] || ! bench/.venv/bin/python -c "import torch" 2>/dev/null; then
  python3 -m venv bench/.venv
  bench/.venv/bin/pip install --quiet torch safetensors numpy
fi
# The ResNets' reference is torchvision's own models (PyPI). --no-deps keeps the torch above:
# the models are plain Python; none of torchvision's compiled ops is used.
if ! bench/.venv/bin/python -c "import torchvision" 2>/dev/null; then
  bench/.venv/bin/pip install --quiet pillow
  bench/.venv/bin/pip install --quiet --no-deps torchvision
fi
cargo build --locked --quiet --release
cargo build --locked --quiet
echo "# machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
echo "# torch $(bench/.venv/bin/python -c 'import torch; print(torch.__version__)'), $(target/release/trainctl --version)"
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--epoch 5120)
bench/.venv/bin/python bench/compare.py "${args[@]}"
echo "# the GEMM alone on the ResNets' shapes, fp32 and bf16, against this core's measured multiply-add peak"
target/release/trainctl bench --gemm
echo "# trainctl release, each convolution alone (1 thread)"
target/release/trainctl bench --layers
echo "# pytorch, each convolution alone (1 thread)"
bench/.venv/bin/python bench/pytorch_step.py --layers
echo "# resnet18 at 64x64, batch 32, trainctl release: each operation inside the step, then each convolution alone by each algorithm"
target/release/trainctl bench --model resnet18 --image-size 64 --batch-size 32 --threads 1,2 --steps 3 --layers
echo "# the data loader alone: a generated 64x64 JPEG folder (tiny-imagenet's layout)"
loader_data=$(mktemp -d)
target/release/trainctl data synth --tiny --out "$loader_data" --train 4000 --test 200 --classes 200 --image-size 64 >/dev/null
target/release/trainctl bench --loader "$loader_data" --image-size 64 --batch-size 32 --threads 1,2 --batches 100
rm -rf "$loader_data"
echo "# trainctl release: one more step at 1 thread, then the all-reduce and the loopback ceiling"
target/release/trainctl bench --threads 1 --steps 1 --ranks 2,4
