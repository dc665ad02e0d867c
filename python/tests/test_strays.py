"""Copies of the model the loop keeps without giving them (``_strays``): found among the
process's objects, refused once they change, left alone when frozen or given to the job."""

from __future__ import annotations

import copy
import unittest

import torch
from torch.optim.swa_utils import AveragedModel

from trainctl.torch import UsageError
from trainctl.torch._strays import Strays


def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


class StraysTest(unittest.TestCase):
    def test_an_ema_that_changes_is_refused_saying_what_to_do(self) -> None:
        m = model()
        ema = AveragedModel(m)
        strays = Strays(m)
        strays.scan([])
        strays.refuse_changed()
        ema.update_parameters(m)
        with self.assertRaisesRegex(UsageError, "an AveragedModel holding a copy of the model's parameters changes during training but was not given to Elastic"):
            strays.refuse_changed()

    def test_a_dict_of_shadow_weights_is_a_copy_too(self) -> None:
        m = model()
        shadow = {k: v.detach().clone() for k, v in m.state_dict().items()}
        strays = Strays(m)
        strays.scan([])
        with torch.no_grad():
            next(iter(shadow.values())).add_(1.0)
        with self.assertRaisesRegex(UsageError, "a dict of 4 tensors shaped like the model's .*state_dict\\(\\) and load_state_dict\\(\\)"):
            strays.refuse_changed()

    def test_a_frozen_copy_a_given_one_and_the_models_own_views_are_left_alone(self) -> None:
        m = model()
        teacher = copy.deepcopy(m)
        given = AveragedModel(m)
        views = m.state_dict()  # shares the model's storage
        strays = Strays(m)
        strays.scan([given])
        given.update_parameters(m)
        with torch.no_grad():
            m[0].weight.add_(1.0)
        strays.refuse_changed()
        self.assertEqual([c.kind for c in strays.copies], ["Sequential"], "the teacher, found, unchanged")
        del teacher, views


if __name__ == "__main__":
    unittest.main()
