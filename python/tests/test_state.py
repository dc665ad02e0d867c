"""The training state (``_state``): an evaluation a lost peer interrupts leaves no module in the
mode it switched it to."""

from __future__ import annotations

import unittest

import torch
from torch.optim.swa_utils import AveragedModel

from trainctl.torch._kept import Kept
from trainctl.torch._progress import Progress
from trainctl.torch._state import TrainingState


class ModesTest(unittest.TestCase):
    def test_the_modes_an_interrupted_evaluation_changed_are_put_back(self) -> None:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.5))
        ema = AveragedModel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        state = TrainingState(model, optimizer, None, None, Kept([ema]), Progress())
        model[2].eval()  # a module the loop keeps in eval mode on purpose stays so
        restore = state.modes()
        # What an evaluation does before its all_reduce fails: model.train() never comes.
        model.eval()
        ema.eval()
        # The model's Sequential, Linear and BatchNorm; the EMA's five (its copy of the dropout
        # was made in train mode).
        self.assertEqual(restore(), 3 + 5)
        self.assertEqual([m.training for m in model.modules()], [True, True, True, False])
        self.assertTrue(all(m.training for m in ema.modules()))
        self.assertEqual(restore(), 0)


if __name__ == "__main__":
    unittest.main()
