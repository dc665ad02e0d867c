"""A collective's error said in trainctl's words (``_group.describe``), PyTorch's text kept."""

import socket
import unittest

import torch

from trainctl import regroup
from trainctl.torch._group import Group, _sockets, describe, detail


class DescribeTest(unittest.TestCase):
    def test_gloos_callback_error_reads_as_what_happened_to_the_link(self) -> None:
        raw = (
            "Got the following error when running the callback: RuntimeError: "
            "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] "
            "Connection closed by peer [127.0.0.1]:19867"
        )
        self.assertEqual(describe(raw), "the connection to 127.0.0.1:19867 closed (gloo)")

    def test_a_timeout_and_a_reset_are_named(self) -> None:
        self.assertEqual(
            describe("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 30000ms for recv operation to complete"),
            "a collective timed out waiting for a peer (gloo)",
        )
        self.assertEqual(
            describe("[gloo/transport/tcp/pair.cc:534] Connection reset by peer [10.0.0.2]:4431"),
            "the connection to 10.0.0.2:4431 was reset (gloo)",
        )

    def test_an_unknown_error_is_kept_less_its_source_path(self) -> None:
        self.assertEqual(describe("RuntimeError: [x/y.cpp:12] something new"), "something new")

    def test_detail_is_the_first_line_without_the_boilerplate(self) -> None:
        e = RuntimeError("Connection closed by peer [a]:1 This is typically caused by a crash\nmore")
        self.assertEqual(detail(e), "Connection closed by peer [a]:1")


class FailureTest(unittest.TestCase):
    """A lost peer is known from what the package itself did or sees, never from the error's
    words: the same text is the program's own error when nothing else says otherwise."""

    def group(self) -> Group:
        g = Group("gloo", torch.device("cpu"), launched=False)
        g.timeout_s = 30.0
        return g

    def test_wording_alone_decides_nothing(self) -> None:
        said = RuntimeError("[gloo/transport/tcp/pair.cc:561] Connection closed by peer [10.0.0.2]:1")
        self.assertIs(self.group().failure(said, 0.1), regroup.Failure.OTHER)
        self.assertIs(self.group().failure(KeyError("x"), 99.0), regroup.Failure.OTHER)

    def test_an_abort_a_timeout_and_a_broken_link_are_the_groups(self) -> None:
        g = self.group()
        g.aborted = True
        self.assertIs(g.failure(ValueError("Default process group has not been initialized"), 0.0), regroup.Failure.PEER_LOST)
        self.assertIs(self.group().failure(RuntimeError("anything"), 30.0), regroup.Failure.TIMED_OUT)
        g = self.group()
        mine, peer = socket.socketpair()
        try:
            g._links = [(fd, inode) for fd, inode in _sockets().items() if fd == mine.fileno()]
            self.assertEqual(len(g._links), 1)
            self.assertIs(g.failure(RuntimeError("anything"), 0.1), regroup.Failure.OTHER, "an idle link is open")
            peer.close()
            self.assertIs(g.failure(RuntimeError("anything"), 0.1), regroup.Failure.PEER_LOST, "the peer shut its end")
            fd = mine.fileno()
            mine.close()
            g._links = [(fd, "0")]
            self.assertTrue(g.links_broken(), "a descriptor gloo closed is a link gone")
        finally:
            mine.close()
            peer.close()


if __name__ == "__main__":
    unittest.main()
