"""The worker's side of the elastic protocol against its shared cases (``vectors/regroup.json``
at the repository's root), which the Rust side checks too (crates/collective/tests/vectors.rs):
a change that one language does not follow fails here or there."""

from __future__ import annotations

import json
import unittest
from pathlib import Path
from typing import Any

from trainctl import regroup
from trainctl.sampler import Shard, digest
from trainctl.stragglers import Watch

VECTORS = Path(__file__).resolve().parents[2] / "vectors"


def table(name: str) -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = json.loads((VECTORS / "regroup.json").read_text())[name]
    assert cases, f"table {name} has no cases"
    return cases


class RegroupVectorsTest(unittest.TestCase):
    def test_the_flags_a_rank_raises(self) -> None:
        for c in table("raised"):
            i = c["in"]
            got = regroup.raised(i["stop"], i["assigned"], i["leaving"], i["rank"])
            self.assertEqual(got, regroup.Raised(**c["out"]), c["case"])

    def test_what_follows_an_agreed_step(self) -> None:
        for c in table("after_step"):
            i = c["in"]
            got = regroup.after_step(regroup.Agreed(**i["agreed"]), i["me_leaving"], i["checkpoint_due"])
            out = c["out"]
            self.assertEqual(got, regroup.AfterStep(regroup.Do(out["do"]), out.get("saver", 0)), c["case"])

    def test_what_follows_a_failed_collective(self) -> None:
        for c in table("after_failure"):
            i = c["in"]
            got = regroup.after_failure(regroup.Failure(i["failure"]), i["agent"], i["rank"])
            out = c["out"]
            self.assertEqual(got, regroup.AfterFailure(regroup.Do(out["do"]), out.get("save", False)), c["case"])

    def test_what_a_waiting_worker_does(self) -> None:
        for c in table("waiting"):
            i = c["in"]
            got = regroup.waiting(i["leaving"], i["assigned"], i["stop"])
            self.assertEqual(got, regroup.Waiting(c["out"]), c["case"])


    def test_who_saves_on_a_stop_while_waiting(self) -> None:
        for c in table("saver_while_waiting"):
            i = c["in"]
            got = regroup.saver_while_waiting(i["lost"], i["saver"], i["live"])
            self.assertEqual(got, regroup.Save(c["out"]), c["case"])

    def test_what_follows_a_failed_group_start(self) -> None:
        for c in table("after_start_failure"):
            i = c["in"]
            got = regroup.after_start_failure(regroup.Failure(i["failure"]), i["agent"])
            self.assertEqual(got, regroup.Do(c["out"]), c["case"])

    def test_when_a_checkpoint_is_due(self) -> None:
        for c in table("checkpoint_due"):
            i = c["in"]
            got = regroup.checkpoint_due(i["global_step"], i["every"], i["epoch_ends"])
            self.assertIs(got, c["out"], c["case"])

    def test_every_shared_table_is_checked(self) -> None:
        tables = set(json.loads((VECTORS / "regroup.json").read_text())) - {"about"}
        checked = {
            "raised", "after_step", "after_failure", "waiting", "saver_while_waiting",
            "after_start_failure", "checkpoint_due",
        }
        self.assertEqual(tables, checked)


class SamplerVectorsTest(unittest.TestCase):
    """``vectors/sampler.json``: the Rust trainer's sampler checks the same cases."""

    def test_shards_and_digests(self) -> None:
        v = json.loads((VECTORS / "sampler.json").read_text())
        self.assertTrue(v["shard"] and v["digest"])
        for c in v["shard"]:
            i, out = c["in"], c["out"]
            s = Shard(i["order"], i["consumed"], i["world_size"], i["rank"], i["batch_size"])
            self.assertEqual(s.indices, out["indices"], i)
            self.assertEqual((s.unpadded, s.steps), (out["unpadded"], out["steps"]), i)
            self.assertEqual([s.batch(k) for k in range(s.steps)], out["batches"], i)
            self.assertEqual([s.unpadded_batch(k) for k in range(s.steps)], out["unpadded_batches"], i)
            self.assertEqual([s.position_after(k) for k in range(s.steps + 1)], out["positions_after"], i)
        for c in v["digest"]:
            self.assertEqual(digest(c["ids"]), c["digest"], c["ids"])


class StragglerVectorsTest(unittest.TestCase):
    """``vectors/stragglers.json``: the Rust trainer's watch checks the same scenarios."""

    def test_verdicts(self) -> None:
        scenarios = json.loads((VECTORS / "stragglers.json").read_text())["scenarios"]
        self.assertTrue(scenarios)
        for sc in scenarios:
            w = Watch(factor=sc["factor"], window=sc["window"])
            got: list[dict[str, Any]] = []
            for at, ranks in enumerate(sc["steps"]):
                change = w.step([(int(n), float(d), float(c)) for n, d, c in ranks])
                if change is None:
                    continue
                if change[0] == "started":
                    got.append({"at": at, "started": change[1]})
                else:
                    got.append({"at": at, "ended": change[1], "slowdown": change[2]})
            self.assertEqual(len(got), len(sc["changes"]), (sc["case"], got))
            for g, want in zip(got, sc["changes"]):
                self.assertEqual(g["at"], want["at"], sc["case"])
                if "started" in want:
                    s, e = g["started"], want["started"]
                    self.assertEqual((s["node"], s["ranks"], s["cause"]), (e["node"], e["ranks"], e["cause"]), sc["case"])
                    for key in ("slowdown", "data_s", "compute_s", "others_data_s", "others_compute_s"):
                        self.assertAlmostEqual(s[key], e[key], places=9, msg=sc["case"])
                else:
                    self.assertEqual(g["ended"], want["ended"], sc["case"])
                    if want["slowdown"] is None:
                        self.assertIsNone(g["slowdown"], sc["case"])
                    else:
                        self.assertAlmostEqual(g["slowdown"], want["slowdown"], places=9, msg=sc["case"])


if __name__ == "__main__":
    unittest.main()
