"""Reads a directory of TensorBoard event files with TensorBoard's own reader and prints what it
holds as JSON: {"scalars": {tag: [[step, value], ...]}, "histograms": {tag: [[step, min, max, num,
limits, counts], ...]}, "text": {tag: [[step, text], ...]}}. Used by tests/test_io_tensorboard.cpp."""
import json
import sys

from tensorboard.backend.event_processing import event_accumulator as ea
from tensorboard.util import tensor_util


def main(path):
    acc = ea.EventAccumulator(path, size_guidance={ea.SCALARS: 0, ea.HISTOGRAMS: 0, ea.TENSORS: 0})
    acc.Reload()
    tags = acc.Tags()
    out = {"scalars": {}, "histograms": {}, "text": {}}
    for tag in tags["scalars"]:
        out["scalars"][tag] = [[s.step, s.value] for s in acc.Scalars(tag)]
    for tag in tags["histograms"]:
        out["histograms"][tag] = [
            [h.step, h.histogram_value.min, h.histogram_value.max, h.histogram_value.num,
             list(h.histogram_value.bucket_limit), list(h.histogram_value.bucket)]
            for h in acc.Histograms(tag)]
    for tag in tags["tensors"]:
        out["text"][tag] = [[t.step, tensor_util.make_ndarray(t.tensor_proto).item().decode()]
                            for t in acc.Tensors(tag)]
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1])
