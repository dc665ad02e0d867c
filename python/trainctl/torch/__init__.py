"""Elastic data-parallel PyTorch under ``trainctl run``: a lost node costs the survivors the
step in flight, a joining node costs them no completed step, no worker process restarts, no
checkpoint is read, and every epoch's sample digest proves each sample was trained once.

A plain DDP program changes in a handful of lines::

    from trainctl.torch import Elastic

    job = Elastic(model, optimizer, dataset_size=len(train), batch_size=args.batch_size,
                  out=args.out)
    for epoch in job.epochs(args.epochs):
        for indices in job.batches():            # this rank's samples of the next step
            x, y = images[indices], labels[indices]
            with job.step() as step:             # a lost peer: the step is dropped and the
                loss = criterion(job.model(x), y)    # workers regroup in place
                loss.backward()
                step.loss = loss
        scheduler.step()
    job.finish()

``job.model`` is the model wrapped in ``DistributedDataParallel`` (wrapped again after each
regroup); the optimizer is stepped by ``job.step()``'s end, once every rank agreed that the step
is whole. Under plain ``torchrun`` (no control channel) or run alone, the same program is
ordinary DDP code and a failure ends it, as it always did.
"""

from ._elastic import Elastic, Step

__all__ = ["Elastic", "Step"]
