"""The seed CNN's (or a torchvision ResNet's) training step in PyTorch, timed the way
`trainctl bench` times trainctl's.

Usage: python bench/pytorch_step.py [--threads 1,2] [--batch-size 128] [--steps 5] [--warmup 5]
       [--model seed-cnn|resnet18|resnet34|resnet50|resnet101] [--image-size 32]
       [--precision fp32|bf16]
With --precision bf16 the forward runs under torch.autocast("cpu", dtype=torch.bfloat16), as
PyTorch's documentation recommends for CPU mixed precision (oneDNN's bf16 convolutions; the
weights, the optimizer and batch norm stay fp32).
Prints one JSON line per thread count. Also times gloo's all-reduce of the same gradient size
with --allreduce-ranks (processes on 127.0.0.1), for the side-by-side in docs/PERFORMANCE.md.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn


def seed_cnn():
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.BatchNorm2d(64),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(),
        nn.Conv2d(128, 128, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.BatchNorm2d(128),
        nn.Conv2d(128, 256, 3, padding=1), nn.ReLU(),
        nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.BatchNorm2d(256),
        nn.Flatten(),
        nn.Linear(4096, 512), nn.ReLU(),
        nn.Linear(512, 10),
    )


def network(name):
    """The seed CNN, or torchvision's ResNet with tiny-imagenet's 200 classes (as trainctl bench)."""
    if name == "seed-cnn":
        return seed_cnn(), 10
    import torchvision  # only the ResNets need it (bench/run.sh installs it)
    return getattr(torchvision.models, name)(num_classes=200), 200


def step_times(threads, batch_size, steps, name="seed-cnn", size=32, precision="fp32", warmup=5):
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model, classes = network(name)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, weight_decay=1e-4)
    loss_fn = nn.CrossEntropyLoss()
    x = torch.randn(batch_size, 3, size, size)
    y = torch.randint(0, classes, (batch_size,))
    times = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        loss.item()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    step = statistics.median(times)
    return {"impl": "pytorch", "torch": torch.__version__, "model": name, "image_size": size,
            "threads": threads, "precision": precision,
            "batch_size": batch_size, "steps": steps, "warmup_steps": warmup, "step_s": step,
            "images_per_s": batch_size / step}


CONV_LAYERS = [("network.0", 3, 32, 32), ("network.2", 32, 64, 32), ("network.6", 64, 128, 16),
               ("network.8", 128, 128, 16), ("network.12", 128, 256, 8), ("network.14", 256, 256, 8)]


def layer_times(batch_size, repeats):
    """Each convolution alone, as `trainctl bench --layers` times it (1 thread)."""
    torch.set_num_threads(1)
    out = []
    for name, c_in, c_out, size in CONV_LAYERS:
        conv = nn.Conv2d(c_in, c_out, 3, padding=1)
        x = torch.ones(batch_size, c_in, size, size, requires_grad=True)
        fwd, bwd = [], []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            y = conv(x)
            t1 = time.perf_counter()
            y.sum().backward()
            t2 = time.perf_counter()
            if i > 0:
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
        f, b = statistics.median(fwd), statistics.median(bwd)
        flops = 2 * batch_size * size * size * c_out * c_in * 9
        out.append({"impl": "pytorch", "layer": name, "input": [batch_size, c_in, size, size], "c_out": c_out,
                    "forward_s": f, "backward_s": b, "gflops_per_s": 3 * flops / (f + b) / 1e9})
    return out


def allreduce_worker(rank, ranks, port, floats, repeats, out):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
    buf = torch.ones(floats)
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(buf)
        times.append(time.perf_counter() - t)
    if rank == 0:
        med = statistics.median(times[1:])
        out.put({"impl": "pytorch-gloo", "ranks": ranks, "floats": floats, "repeats": repeats,
                 "median_s": med, "bus_gbytes_per_s": 2 * (ranks - 1) / ranks * floats * 4 / med / 1e9})
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", default="1,2")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=5, help="timed steps; the figure is their median")
    p.add_argument("--warmup", type=int, default=5,
                   help="untimed steps before them (as many as `trainctl bench --warmup`)")
    p.add_argument("--model", default="seed-cnn")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--allreduce-ranks", default="2,4")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--layers", action="store_true", help="time each convolution alone instead")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    a = p.parse_args()
    if a.layers:
        for row in layer_times(a.batch_size, a.steps):
            print(json.dumps(row), flush=True)
        return 0
    for t in a.threads.split(","):
        print(json.dumps(step_times(int(t), a.batch_size, a.steps, a.model, a.image_size, a.precision, a.warmup)),
              flush=True)
    floats = sum(p.numel() for p in seed_cnn().parameters())
    import socket
    import torch.multiprocessing as mp
    for ranks in [int(r) for r in a.allreduce_ranks.split(",") if r]:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        procs = [ctx.Process(target=allreduce_worker, args=(r, ranks, port, floats, a.repeats, out)) for r in range(ranks)]
        for proc in procs:
            proc.start()
        result = out.get(timeout=300)
        for proc in procs:
            proc.join(timeout=60)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
