"""The state the loop keeps (``_kept``): what travels in the shape it was given, the AveragedModel
gated like the scheduler, what follows a step that applied no update undone, and fingerprints
that tell states apart."""

from __future__ import annotations

import unittest

import torch
from torch.optim.swa_utils import AveragedModel

from trainctl.torch import UsageError
from trainctl.torch._kept import Kept


class Best:
    def __init__(self) -> None:
        self.value = 0.0

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, d: dict[str, float]) -> None:
        self.value = d["value"]


class KeptTest(unittest.TestCase):
    def test_state_travels_in_the_shape_it_was_given(self) -> None:
        for given in (Best(), [Best(), Best()], {"best": Best(), "last": Best()}):
            kept = Kept(given)
            for _, obj in kept.objects:
                obj.value = 3.0
            saved = kept.state_dict()
            for _, obj in kept.objects:
                obj.value = 0.0
            kept.load_state_dict(saved)
            self.assertTrue(all(obj.value == 3.0 for _, obj in kept.objects), given)
        with self.assertRaisesRegex(UsageError, "give state= as the run that saved it did"):
            Kept([Best()]).load_state_dict([{"value": 1.0}, {"value": 2.0}])

    def test_an_object_without_state_dict_is_refused_by_name(self) -> None:
        with self.assertRaisesRegex(UsageError, r"Elastic's state\['best'\] is a float, which has no state_dict"):
            Kept({"best": 0.5})

    def test_fingerprints_tell_states_apart_by_name(self) -> None:
        a, b = Best(), Best()
        kept = Kept([a, b])
        before = kept.fingerprints()
        self.assertEqual(set(before), {"state[0]", "state[1]"})
        b.value = 1.0
        after = kept.fingerprints()
        self.assertEqual(before["state[0]"], after["state[0]"])
        self.assertNotEqual(before["state[1]"], after["state[1]"])

    def test_what_follows_a_step_that_applied_no_update_is_undone(self) -> None:
        best = Best()
        kept = Kept(best)
        best.value = 1.0
        kept.hold()
        best.value = 2.0  # the loop's code after a dropped step
        self.assertEqual(kept.undo(), ["state"])
        self.assertEqual(best.value, 1.0)
        kept.hold()
        self.assertEqual(kept.undo(), [], "nothing changed, nothing undone")
        self.assertEqual(kept.undo(), [], "undone once")

    def test_an_averaged_models_update_is_gated(self) -> None:
        model = torch.nn.Linear(2, 1)
        ema = AveragedModel(model)
        kept = Kept(ema)
        allow = {"now": False}
        asked: list[str] = []

        def may_run(what: str) -> bool:
            asked.append(what)
            return allow["now"]

        kept.gate(may_run)
        ema.update_parameters(model)
        self.assertEqual(int(ema.n_averaged), 0, "no update applied: nothing averaged")
        allow["now"] = True
        ema.update_parameters(model)
        self.assertEqual(int(ema.n_averaged), 1)
        self.assertEqual(asked, ["state.update_parameters()"] * 2)
        self.assertIsInstance(ema, AveragedModel)
        self.assertEqual(set(ema.state_dict()), set(AveragedModel(model).state_dict()))


if __name__ == "__main__":
    unittest.main()
