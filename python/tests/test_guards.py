"""The guards (``_guards``): the loop's own optimizer and scaler steps are refused, the
scheduler steps only when the job allows it, and none of them changes what the objects save."""

from __future__ import annotations

import pickle
import unittest

import torch

from trainctl.torch import UsageError
from trainctl.torch._guards import gate_scheduler, guard_optimizer, guard_scaler, refuse_stray_scheduler


class FakeJob:
    """What the guards ask of the job: whether it steps now, whether an update may follow."""

    def __init__(self) -> None:
        self._stepping = False
        self.allow = True

    def stepping(self) -> bool:
        return self._stepping

    def may_run(self, what: str) -> bool:
        return self.allow


def parts() -> tuple[torch.nn.Linear, torch.optim.SGD]:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, optimizer


class GuardsTest(unittest.TestCase):
    def test_the_loops_optimizer_step_is_refused_and_the_jobs_is_not(self) -> None:
        model, optimizer = parts()
        job = FakeJob()
        handle = guard_optimizer(job.stepping, optimizer)
        model(torch.ones(1, 2)).sum().backward()
        before = model.weight.detach().clone()
        with self.assertRaisesRegex(UsageError, "optimizer.step\\(\\) was called by the training loop"):
            optimizer.step()
        self.assertTrue(torch.equal(model.weight, before), "refused before it changed anything")
        job._stepping = True
        optimizer.step()
        self.assertFalse(torch.equal(model.weight, before))
        handle.remove()

    def test_a_gated_scheduler_steps_when_the_job_allows_and_saves_as_its_own_class(self) -> None:
        _, optimizer = parts()
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        plain = scheduler.state_dict()
        job = FakeJob()
        gate_scheduler(job.may_run, scheduler)
        self.assertEqual(set(scheduler.state_dict()), set(plain))
        self.assertIsInstance(scheduler, torch.optim.lr_scheduler.StepLR)
        job.allow = False
        scheduler.step()
        self.assertEqual(scheduler.last_epoch, 0)
        job.allow = True
        scheduler.step()
        self.assertEqual((scheduler.last_epoch, optimizer.param_groups[0]["lr"]), (1, 0.05))
        copy = pickle.loads(pickle.dumps(scheduler))
        self.assertIs(type(copy), torch.optim.lr_scheduler.StepLR)

    def test_the_scalers_step_and_update_are_the_jobs(self) -> None:
        model, optimizer = parts()
        scaler = torch.amp.GradScaler("cpu")
        job = FakeJob()
        guard_scaler(job.stepping, scaler)
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        for call in (lambda: scaler.step(optimizer), scaler.update):
            with self.assertRaisesRegex(UsageError, "the GradScaler given to Elastic is stepped and updated by the job"):
                call()
        job._stepping = True
        scaler.step(optimizer)
        scaler.update()
        self.assertEqual(set(scaler.state_dict()), set(torch.amp.GradScaler("cpu").state_dict()))

    def test_a_scheduler_not_given_is_found_by_the_optimizer_it_wraps(self) -> None:
        _, optimizer = parts()
        refuse_stray_scheduler(optimizer, None)
        torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1.0, total_steps=10)
        with self.assertRaisesRegex(UsageError, "an LR scheduler was made for this optimizer but not given"):
            refuse_stray_scheduler(optimizer, None)


if __name__ == "__main__":
    unittest.main()
