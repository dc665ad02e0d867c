#!/usr/bin/env python3
"""Reads trainctl's telemetry with the reference implementations, printing JSON.

  read_telemetry.py tensorboard LOGDIR   TensorBoard's EventAccumulator over LOGDIR:
                                         {"scalars": {tag: [[step, value], ...]},
                                          "text": {tag: markdown}}
  read_telemetry.py prometheus < TEXT    prometheus_client's text-format parser:
                                         [{"name", "type", "samples": [[name, labels, value]]}]

A user can do the same: `tensorboard --logdir RUN_DIR/tensorboard` reads these files.
"""
import json
import math
import sys


def tensorboard(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    scalars = {t: [[e.step, e.value] for e in acc.Scalars(t)] for t in tags["scalars"]}
    text = {}
    for tag in acc.PluginTagToContent("text"):
        events = acc.Tensors(tag)
        text[tag] = events[-1].tensor_proto.string_val[0].decode("utf-8")
    return {"scalars": scalars, "text": text}


def prometheus(text):
    from prometheus_client.parser import text_string_to_metric_families

    def value(v):
        return None if math.isnan(v) else v

    return [
        {
            "name": f.name,
            "type": f.type,
            "samples": [[s.name, s.labels, value(s.value)] for s in f.samples],
        }
        for f in text_string_to_metric_families(text)
    ]


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "tensorboard":
        out = tensorboard(sys.argv[2])
    elif len(sys.argv) == 2 and sys.argv[1] == "prometheus":
        out = prometheus(sys.stdin.read())
    else:
        sys.exit(__doc__)
    json.dump(out, sys.stdout)
