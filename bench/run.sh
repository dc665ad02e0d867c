#!/usr/bin/env bash
# Side-by-side figures for docs/PERFORMANCE.md: trainctl and PyTorch, same machine, same run.
# Installs PyTorch from PyPI into bench/.venv on first use.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x bench/.venv/bin/python ] || ! bench/.venv/bin/python -c "import torch" 2>/dev/null; then
  python3 -m venv bench/.venv
  bench/.venv/bin/pip install --quiet torch safetensors numpy
fi
cargo build --locked --quiet
echo "# machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
echo "# trainctl"
target/debug/trainctl bench "$@"
echo "# pytorch"
bench/.venv/bin/python bench/pytorch_step.py
echo "# trainctl, each convolution alone (1 thread)"
target/debug/trainctl bench --layers
echo "# pytorch, each convolution alone (1 thread)"
bench/.venv/bin/python bench/pytorch_step.py --layers
