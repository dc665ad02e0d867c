#!/usr/bin/env python3
"""What trainctl.torch costs a step when nothing fails: the same seed-CNN training loop, plain
DDP (DistributedSampler, DataLoader-free indexing) and with ``Elastic`` (its per-step flags
all-reduce, records and digest), each run under ``trainctl run --standalone --nproc-per-node 2``,
alternated round by round on the same machine, which runs first swapping every round.
Prints each round's steps/s and the medians.

Usage: bench/pytorch_elastic_cost.py [--rounds 5] [--steps 150] [--batch-size 32]
                                    [--python target/pyenv/bin/python] [--trainctl target/release/trainctl]
The worker side of a round: pytorch_elastic_cost.py --worker plain|elastic ...
"""
import argparse
import os
import sys
import time

import alternated

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def worker(args):
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, os.path.join(ROOT, "examples", "pytorch"))
    from elastic_cifar import Net

    torch.set_num_threads(1)
    torch.manual_seed(0)
    n = args.steps * args.batch_size * 2
    images = torch.randn(n, 3, 32, 32)
    labels = torch.randint(0, 10, (n,))
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, weight_decay=1e-4)
    if args.worker == "plain":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel
        from torch.utils.data import DistributedSampler

        dist.init_process_group("gloo")
        ddp = DistributedDataParallel(model)
        sampler = DistributedSampler(range(n), shuffle=True, seed=0)
        indices = list(sampler)
        start = time.perf_counter()
        for s in range(args.steps):
            batch = indices[s * args.batch_size : (s + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(ddp(images[batch]), labels[batch])
            loss.backward()
            optimizer.step()
            loss.item()
        seconds = time.perf_counter() - start
        rank = dist.get_rank()
        dist.destroy_process_group()
    else:
        from trainctl.torch import Elastic

        job = Elastic(model, optimizer, dataset_size=n, batch_size=args.batch_size, out=args.out)
        start = time.perf_counter()
        for _ in job.epochs(1):
            for batch in job.batches():
                with job.step() as step:
                    loss = F.cross_entropy(job.model(images[batch]), labels[batch])
                    loss.backward()
                    step.loss = loss.item()
        seconds = time.perf_counter() - start
        rank = job.rank
        job.finish()
    if rank == 0:
        print(f"STEPS_PER_S {args.steps / seconds:.3f}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", choices=["plain", "elastic"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--python", default=os.path.join(ROOT, "target", "pyenv", "bin", "python"))
    ap.add_argument("--trainctl", default=os.path.join(ROOT, "target", "release", "trainctl"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    def command(kind, out):
        return [args.trainctl, "run", "--standalone", "--nproc-per-node", "2", "--",
                args.python, os.path.abspath(__file__), "--worker", kind,
                "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--out", out]

    alternated.compare(args.rounds, ("plain", "elastic"), command,
                       {"plain": "plain DDP", "elastic": "trainctl.torch"})

if __name__ == "__main__":
    main()
