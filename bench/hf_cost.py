#!/usr/bin/env python3
"""What trainctl.hf costs a step when nothing fails: the same Hugging Face Trainer script (a
GPT-2 made from a config, random tokens) on the stock ``transformers.Trainer`` and on
``trainctl.hf``, each under ``trainctl run --standalone --nproc-per-node 2``, alternated round
by round (which runs first swapping every round). A callback times the steps after the first
few (the job's start and the first steps' allocations left out). Prints each round's steps/s
and the medians.

Usage: bench/hf_cost.py [--rounds 4] [--steps 60] [--layers 4] [--width 128] [--seq 64]
                        [--batch-size 8] [--python target/pyenv/bin/python]
                        [--trainctl target/release/trainctl]
The worker side of a round: hf_cost.py --worker stock|elastic ...
"""
import argparse
import os
import time

import alternated

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WARMUP = 5


def worker(args):
    if args.worker == "stock":
        from transformers import Trainer, TrainingArguments
    else:
        from trainctl.hf import Trainer, TrainingArguments
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, set_seed

    torch.set_num_threads(1)
    vocab = 512

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return args.steps * args.batch_size * 2

        def __getitem__(self, i):
            ids = torch.randint(0, vocab, (args.seq,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids.clone()}

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_step_end(self, *_, **__):
            self.ends.append(time.perf_counter())

    training = TrainingArguments(
        output_dir=args.out, use_cpu=True, per_device_train_batch_size=args.batch_size,
        max_steps=args.steps, learning_rate=1e-3, seed=0, save_strategy="no", report_to=[],
        disable_tqdm=True, logging_strategy="no",
    )
    set_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=4, vocab_size=vocab,
                        n_positions=args.seq, bos_token_id=0, eos_token_id=0)
    clock = Clock()
    trainer = Trainer(model=GPT2LMHeadModel(config), args=training, train_dataset=Tokens(), callbacks=[clock])
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        timed = clock.ends[WARMUP:]
        print(f"STEPS_PER_S {(len(timed) - 1) / (timed[-1] - timed[0]):.3f}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", choices=["stock", "elastic"])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--python", default=os.path.join(ROOT, "target", "pyenv", "bin", "python"))
    ap.add_argument("--trainctl", default=os.path.join(ROOT, "target", "release", "trainctl"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    shape = ["--steps", str(args.steps), "--layers", str(args.layers), "--width", str(args.width),
             "--seq", str(args.seq), "--batch-size", str(args.batch_size)]

    def command(kind, out):
        return [args.trainctl, "run", "--standalone", "--nproc-per-node", "2", "--",
                args.python, os.path.abspath(__file__), "--worker", kind, "--out", out, *shape]

    alternated.compare(args.rounds, ("stock", "elastic"), command,
                       {"stock": "stock Trainer", "elastic": "trainctl.hf"})

if __name__ == "__main__":
    main()
