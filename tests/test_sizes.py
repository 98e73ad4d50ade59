"""Sizes checked before allocation (issue 49): every setting that multiplies into a tensor size is
checked against the machine's memory before anything is allocated (``szo.build.check_sizes``, run by
``szo.stages.preflight``): ``--set model.T=1000000000`` tried to allocate 8 TB."""
from __future__ import annotations

import pytest

from szo.build import check_sizes, memory_budget
from szo.config import load_recipe


@pytest.mark.parametrize("sets, names", [
    (["model.T=1000000000"], r"^model.T = 1000000000 x data.batch_size = 64 x \d+ bytes .* lower model.T or "
                             r"data.batch_size$"),
    (["data.batch_size=100000000000"], r"^model.T = 4 x data.batch_size = 100000000000 x "),
    (["data.test_batch_size=100000000000"], r"^model.T = 4 x data.test_batch_size = 100000000000 x "),
    (["subspace.k=1000000000"], r"^subspace.k = 1000000000 directions of the model's d = 5082 parameters is a basis "
                                r"of [0-9.]+ TiB in float32, more than this machine's .*; lower subspace.k$"),
    (["model.kwargs={width: 100000}"], r"^model spike_convnet with model.kwargs \{'width': 100000\} has \d+ "
                                       r"parameters .* lower its width / sizes$"),
    (["szo.engine=batched", "szo.chunk=100000000000"], r"^model.T = 4 x data.batch_size = 64 x szo.chunk = "
                                                       r"100000000000 probe copies x "),
    (["szo.time_chunk=1", "model.T=1000000000", "data.batch_size=10000000000000"],
     r"^model.T = 1000000000 \(szo.time_chunk = 1\) x data.batch_size = 10000000000000 x "),
])
def test_sizes_beyond_the_machine_are_refused_in_one_line(sets, names):
    with pytest.raises(ValueError, match=names) as e:
        check_sizes(load_recipe("digits-scratch", sets))
    assert "\n" not in str(e.value)


def test_the_recipes_sizes_pass():
    assert memory_budget("cpu") > 2**28
    for name in ("digits-scratch", "digits-bp", "nmnist-scratch", "cifar10-scratch"):
        check_sizes(load_recipe(name))
    check_sizes(load_recipe("digits-scratch", ["szo.time_chunk=1", "model.T=100000"]))  # streams: T not held at once
