"""The seed job in PyTorch DDP (gloo, CPU): the counterpart of
`trainctl run --standalone --nproc-per-node 2 train`, for bench/compare.py's whole-job timing.

Usage: torchrun --standalone --nproc-per-node 2 bench/pytorch_ddp.py --data DIR [--epochs 1]
Reads CIFAR-10's binary layout (data_batch_*.bin) from DIR or DIR/cifar-10-batches-bin, trains
the seed CNN with the reference hyperparameters (batch 128 per worker, SGD lr 1e-3, momentum 0.9,
weight decay 1e-4) and prints one JSON line from rank 0.
"""

import argparse
import glob
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from pytorch_step import seed_cnn


def load(data):
    folder = os.path.join(data, "cifar-10-batches-bin")
    if not os.path.isdir(folder):
        folder = data
    files = sorted(glob.glob(os.path.join(folder, "data_batch_*.bin")))
    raw = np.concatenate([np.fromfile(f, dtype=np.uint8).reshape(-1, 3073) for f in files])
    labels = torch.from_numpy(raw[:, 0].astype(np.int64))
    images = torch.from_numpy(raw[:, 1:].astype(np.float32).reshape(-1, 3, 32, 32) / 255.0)
    mean = torch.tensor([0.5, 0.5, 0.5]).view(1, 3, 1, 1)
    return (images - mean) / 0.5, labels


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                   help="bf16: the forward under torch.autocast('cpu', dtype=torch.bfloat16)")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    images, labels = load(args.data)
    model = nn.parallel.DistributedDataParallel(seed_cnn())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, weight_decay=1e-4)
    loss_fn = nn.CrossEntropyLoss()
    start = time.perf_counter()
    steps = 0
    for epoch in range(args.epochs):
        g = torch.Generator().manual_seed(epoch)
        order = torch.randperm(len(labels), generator=g)[rank::world]
        for i in range(0, len(order), args.batch_size):
            idx = order[i:i + args.batch_size]
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
                loss = loss_fn(model(images[idx]), labels[idx])
            loss.backward()
            opt.step()
            steps += 1
    seconds = time.perf_counter() - start
    if rank == 0:
        print(json.dumps({"impl": "pytorch-ddp", "world_size": world, "steps": steps,
                          "train_s": seconds, "loss": loss.item()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
