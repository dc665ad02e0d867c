"""What ends the job (``_errors``): an unrecoverable error in torchrun's error-file format,
marked for the launcher, and a worker that ends on one exits with the code no launcher retries."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import unittest

import torch

from trainctl.torch import DivergedError, UsageError
from trainctl.torch._errors import EXIT_UNRECOVERABLE, unrecoverable
from trainctl.torch._guards import refuse_unreduced

HERE = os.path.dirname(os.path.abspath(__file__))


class ErrorsTest(unittest.TestCase):
    def test_the_packages_refusals_end_the_worker_unretried_with_the_error_file(self) -> None:
        self.assertTrue(unrecoverable(UsageError("x")) and unrecoverable(DivergedError("x")))
        self.assertFalse(unrecoverable(ValueError("x")))
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "error.json")
            program = "import trainctl.torch as t\nraise t.DivergedError('the ranks parted\\n  lr: rank 0: 1; rank 1: 2')"
            env = dict(os.environ, TORCHELASTIC_ERROR_FILE=path, PYTHONPATH=os.path.dirname(HERE))
            out = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True)
            self.assertEqual(out.returncode, EXIT_UNRECOVERABLE, out.stderr)
            self.assertIn("trainctl.torch.DivergedError: the ranks parted", out.stderr)
            with open(path) as f:
                record = json.load(f)["message"]
            self.assertEqual(record["message"], "DivergedError: the ranks parted\n  lr: rank 0: 1; rank 1: 2")
            self.assertEqual(record["extraInfo"]["trainctl"], "unrecoverable")
            self.assertIn("Traceback", record["extraInfo"]["py_callstack"])
            # A program's own exception is Python's exit 1, retried as torchrun retries it.
            out = subprocess.run([sys.executable, "-c", "import trainctl.torch\nraise ValueError('x')"], env=env, capture_output=True)
            self.assertEqual(out.returncode, 1)

    def test_unreduced_gradients_name_the_parameters_that_received_none(self) -> None:
        class Net(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.body = torch.nn.Linear(2, 2)
                self.aux = torch.nn.Linear(2, 1)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.body(x)

        net = Net()
        net(torch.ones(1, 2)).sum().backward()
        with self.assertRaisesRegex(UsageError, r"2 parameter\(s\) received no gradient \(aux.weight, aux.bias\).*find_unused_parameters"):
            refuse_unreduced(net, False, {})
        # With find_unused_parameters, unused ones are expected: what is left is no_sync().
        with self.assertRaisesRegex(UsageError, "its backward ran under no_sync()"):
            refuse_unreduced(net, False, {"find_unused_parameters": True})
        refuse_unreduced(net, True, {"find_unused_parameters": True})


if __name__ == "__main__":
    unittest.main()
