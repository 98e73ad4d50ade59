"""Writes ``sinabs_cnn.nir``: sinabs 3.1.3's own NIR export (``sinabs.nir.to_nir``) of a small
N-MNIST CNN of the Speck form (the NIR paper's ``cnn_sinabs``: Conv2d -> IAF -> SumPool2d, twice,
then Flatten -> Linear -> IAF; 4 and 8 channels here instead of 16 and 32, seeded weights x3 so
that every layer spikes). Kept as sinabs writes it (IF with r = 1, v_reset 0, no dt, no
metadata) except for the Conv2d ``input_shape`` and the Flatten ``input_type`` that sinabs leaves None
and nir 1.0.8's writer cannot store (the shapes each receives, filled in below).

Run (sinabs pins nir <= 1.0.4: install it aside, e.g. ``pip install --no-deps sinabs samna pbr``):
``python tests/export/data/make_sinabs_cnn.py`` (writes next to this file).
"""
from pathlib import Path

import nir
import numpy as np
import sinabs.layers as sl
import torch
from sinabs.nir import to_nir


def sinabs_cnn() -> torch.nn.Sequential:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(2, 4, 3, padding=1, bias=False), sl.IAFSqueeze(batch_size=1),
        sl.SumPool2d(2),
        torch.nn.Conv2d(4, 8, 3, padding=1, stride=2, bias=False), sl.IAFSqueeze(batch_size=1),
        sl.SumPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 4 * 4, 10, bias=False), sl.IAFSqueeze(batch_size=1))
    with torch.no_grad():
        for m in net:
            if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)):
                m.weight.mul_(3.0)
    return net


if __name__ == "__main__":
    g = to_nir(sinabs_cnn(), torch.zeros(1, 2, 34, 34))
    for name, hw in (("0", (34, 34)), ("3", (17, 17))):  # what each Conv2d receives (sinabs leaves None)
        old = g.nodes[name]
        g.nodes[name] = nir.Conv2d(input_shape=hw, weight=np.asarray(old.weight), stride=old.stride,
                                   padding=old.padding, dilation=old.dilation, groups=old.groups,
                                   bias=np.asarray(old.bias))
    old = g.nodes["6"]  # the Flatten, whose input type sinabs leaves None
    g.nodes["6"] = nir.Flatten(input_type={"input": np.array([8, 4, 4])}, start_dim=old.start_dim, end_dim=old.end_dim)
    nir.write(Path(__file__).with_name("sinabs_cnn.nir"), g)
