#!/usr/bin/env python3
"""The NCCL side of trainctl.torch on a machine with a GPU (not part of the test suite: CI has
no GPU). One process, world size 1 on GPU 0: Elastic on the NCCL backend trains steps (its
flags all-reduce and the state broadcast on the device), then the abort path PyTorch documents
for a broken communicator (`_abort_process_group`, what an agent's Abort calls) runs, a
collective after it must fail instead of hanging, and the group is torn down and started
again, as a regroup does. Prints one line per check and exits non-zero on the first failure.

Usage: PYTHONPATH=python python3 scripts/gpu_nccl_check.py
"""
import os
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    if not torch.cuda.is_available():
        print("SKIPPED: no CUDA device")
        return 0
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, NCCL {torch.cuda.nccl.version()}")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()), TORCHELASTIC_RUN_ID="gpu-check")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    from trainctl.torch import Elastic

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = f"/tmp/gpu-check-{os.getpid()}"
    job = Elastic(model, optimizer, dataset_size=256, batch_size=32, out=out)
    assert job.backend == "nccl", job.backend
    x = torch.randn(256, 64, device="cuda")
    y = torch.randint(0, 10, (256,), device="cuda")
    for _ in job.epochs(1):
        for idx in job.batches():
            with job.step() as step:
                loss = torch.nn.functional.cross_entropy(job.model(x[idx]), y[idx])
                loss.backward()
                step.loss = loss.item()
    print(f"ok: {job.progress['global_step']} steps on NCCL, {job.progress['samples_seen']} samples")

    # The abort an agent's Abort triggers, then a collective on the aborted group.
    t = torch.ones(1, device="cuda")
    job._abort_links()
    result = {}

    def collective():
        try:
            dist.all_reduce(t)
            torch.cuda.synchronize()
            result["ok"] = True
        except Exception as e:  # noqa: BLE001
            result["error"] = e

    th = threading.Thread(target=collective, daemon=True)
    th.start()
    th.join(60)
    if th.is_alive():
        print("FAILED: a collective after the abort hangs")
        return 1
    if "error" in result:
        print(f"ok: after the abort a collective fails: {type(result['error']).__name__}: {str(result['error'])[:120]}")
    else:
        print("note: after the abort a collective of world size 1 returned (nothing to wait for)")
    counted = job._collective_error(result.get("error", RuntimeError("NCCL")))
    print(f"{'ok' if counted else 'FAILED'}: the error counts as a lost peer (regroup): {counted}")
    if not counted:
        return 1
    job._teardown()
    # A new group in the same process, as a regroup starts one.
    os.environ["MASTER_PORT"] = str(free_port())
    started = time.monotonic()
    synced = job._start_group()
    print(f"ok: a new NCCL group in the same process in {time.monotonic() - started:.2f} s ({synced})")
    job.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
