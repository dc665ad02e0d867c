#!/usr/bin/env python3
"""What trainctl.lightning costs a step when nothing fails: the same Lightning script (a small
CNN on generated 32x32 images, SGD with momentum) on the stock ``lightning.pytorch.Trainer``
under plain torchrun and on ``trainctl.lightning``'s under ``trainctl run``, two workers each
(``--standalone --nproc-per-node 2``), alternated round by round (which runs first swapping
every round). A callback times the steps after the first few (the job's start and the first
steps' allocations left out); the integration's scheduled checkpoint (every 100 steps, its
default) falls inside the timed steps. Prints each round's steps/s and the medians.

Usage: bench/lightning_cost.py [--rounds 4] [--steps 150] [--batch-size 32]
                               [--python target/pyenv/bin/python]
                               [--trainctl target/release/trainctl]
The worker side of a round: lightning_cost.py --worker stock|elastic ...
"""
import argparse
import os
import time

import alternated

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WARMUP = 5


def worker(args):
    import torch
    import torch.nn.functional as F
    import lightning.pytorch as L

    if args.worker == "stock":
        from lightning.pytorch import Trainer
    else:
        from trainctl.lightning import Trainer

    torch.set_num_threads(1)

    class Images(torch.utils.data.Dataset):
        def __len__(self):
            return args.steps * args.batch_size * 2

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return torch.randn(3, 32, 32, generator=g), int(torch.randint(0, 10, (1,), generator=g))

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            c = torch.nn
            self.net = c.Sequential(
                c.Conv2d(3, 32, 3, padding=1), c.BatchNorm2d(32), c.ReLU(), c.MaxPool2d(2),
                c.Conv2d(32, 64, 3, padding=1), c.BatchNorm2d(64), c.ReLU(), c.MaxPool2d(2),
                c.Conv2d(64, 128, 3, padding=1), c.ReLU(), c.AdaptiveAvgPool2d(1), c.Flatten(), c.Linear(128, 10),
            )

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(Images(), batch_size=args.batch_size, shuffle=True)

    class Clock(L.Callback):
        def __init__(self):
            self.ends = []

        def on_train_batch_end(self, *_):
            self.ends.append(time.perf_counter())

    L.seed_everything(0, verbose=False)
    clock = Clock()
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=args.steps, default_root_dir=args.out,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[clock],
    )
    trainer.fit(Net())
    if trainer.global_rank == 0:
        timed = clock.ends[WARMUP:]
        print(f"STEPS_PER_S {(len(timed) - 1) / (timed[-1] - timed[0]):.3f}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", choices=["stock", "elastic"])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--python", default=os.path.join(ROOT, "target", "pyenv", "bin", "python"))
    ap.add_argument("--trainctl", default=os.path.join(ROOT, "target", "release", "trainctl"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    shape = ["--steps", str(args.steps), "--batch-size", str(args.batch_size)]

    def command(kind, out):
        launcher = (
            [args.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
            if kind == "stock"
            else [args.trainctl, "run", "--standalone", "--nproc-per-node", "2", "--", args.python]
        )
        return [*launcher, os.path.abspath(__file__), "--worker", kind, "--out", out, *shape]

    alternated.compare(args.rounds, ("stock", "elastic"), command,
                       {"stock": "stock Trainer", "elastic": "trainctl.lightning"})

if __name__ == "__main__":
    main()
