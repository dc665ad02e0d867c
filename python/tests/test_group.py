"""A collective's error said in trainctl's words (``_group.describe``), PyTorch's text kept."""

import unittest

from trainctl.torch._group import describe, detail


class DescribeTest(unittest.TestCase):
    def test_gloos_callback_error_reads_as_what_happened_to_the_link(self):
        raw = (
            "Got the following error when running the callback: RuntimeError: "
            "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] "
            "Connection closed by peer [127.0.0.1]:19867"
        )
        self.assertEqual(describe(raw), "the connection to 127.0.0.1:19867 closed (gloo)")

    def test_a_timeout_and_a_reset_are_named(self):
        self.assertEqual(
            describe("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 30000ms for recv operation to complete"),
            "a collective timed out waiting for a peer (gloo)",
        )
        self.assertEqual(
            describe("[gloo/transport/tcp/pair.cc:534] Connection reset by peer [10.0.0.2]:4431"),
            "the connection to 10.0.0.2:4431 was reset (gloo)",
        )

    def test_an_unknown_error_is_kept_less_its_source_path(self):
        self.assertEqual(describe("RuntimeError: [x/y.cpp:12] something new"), "something new")

    def test_detail_is_the_first_line_without_the_boilerplate(self):
        e = RuntimeError("Connection closed by peer [a]:1 This is typically caused by a crash\nmore")
        self.assertEqual(detail(e), "Connection closed by peer [a]:1")


if __name__ == "__main__":
    unittest.main()
