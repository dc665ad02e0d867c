"""The safety net's pieces (``_check``): a value in a rank's slots, and the message."""

import unittest

from trainctl.torch._check import describe, slots, state_hash, unpack


class CheckTest(unittest.TestCase):
    def test_every_ranks_value_comes_back_from_the_summed_slots(self) -> None:
        values = [0xFFFFFFFF, 1, 0, 0x12345678]
        summed = [sum(col) for col in zip(*(slots(r, 4, v) for r, v in enumerate(values)))]
        self.assertEqual(unpack(summed, 4), values)

    def test_a_hash_is_never_zero_and_follows_every_value(self) -> None:
        a = state_hash({"step": 3, "lr": 0.1})
        self.assertNotEqual(a, 0)
        self.assertNotEqual(a, state_hash({"step": 3, "lr": 0.1 + 1e-17 + 1e-16}))
        self.assertEqual(a, state_hash({"lr": 0.1, "step": 3}))

    def test_the_message_names_what_differs_and_the_ranks(self) -> None:
        details = [
            {"rank": 0, "step": 9, "weights": "0000abcd", "lr": 0.1},
            {"rank": 1, "step": 9, "weights": "0000abcd", "lr": 0.1},
            {"rank": 2, "step": 9, "weights": "0000abcd", "lr": 0.05},
        ]
        text = describe(details, "at step 10 (epoch 1)")
        self.assertIn("at step 10 (epoch 1):", text)
        self.assertIn("  lr: ranks 0-1: 0.1; rank 2: 0.05", text)
        self.assertNotIn("weights:", text)
        self.assertIn("an LR scheduler not given to Elastic", text)


if __name__ == "__main__":
    unittest.main()
