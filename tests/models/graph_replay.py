"""A CPU graph backend that replays the way a CUDA graph does: without running any Python.

:class:`RecordedOps` captures the ATen operations one forward runs (a ``TorchDispatchMode`` sits below
autograd, below every module and every Python hook), and a replay runs that list of operations again
on the same tensors -- parameters, buffers and the static input, at their addresses -- exactly as a
CUDA graph replays its recorded kernels. So an in-place change of a parameter is seen by a replay,
and a forward hook registered after the capture is not run (nor is any other Python of the model:
SyncBatchNorm's hooks, a node perturbation's hook, a clean forward's recording hooks). The
``CallAgain`` backend of tests/models/test_graphed.py re-runs the Python on "replay" and cannot show
that; this one can.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map


class _Ref:
    """An operation's argument that an earlier recorded operation produced (its output ``index``)."""

    def __init__(self, index: int):
        self.index = index


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list = []  # (func, args, kwargs, [output indices])
        self.index: dict[int, int] = {}  # id(tensor) -> index of the output that produced it
        self.keep: list[torch.Tensor] = []  # the produced tensors, alive so that no id is reused
        self.n = 0

    def _arg(self, a):
        if isinstance(a, torch.Tensor) and id(a) in self.index:
            return _Ref(self.index[id(a)])
        return a  # a tensor from outside the forward (parameter, buffer, static input) or a constant

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        rec_args, rec_kwargs = tree_map(self._arg, (args, kwargs))
        outs = []
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.index[id(t)] = self.n
                self.keep.append(t)
                outs.append(self.n)
                self.n += 1
            else:
                outs.append(None)
        self.ops.append((func, rec_args, rec_kwargs, outs))
        return out


class RecordedOps:
    """``capture(fn)``: the warm-up forwards, then one forward recorded op by op; ``replay()`` runs the
    recorded operations again and writes the result into the captured output (see the module doc)."""

    def __init__(self):
        self.captured = 0
        self.replays = 0

    def supports(self, x):
        return True

    def capture(self, fn, warmup, between):
        for _ in range(warmup):
            fn()
            between()
        rec = _Recorder()
        with rec:
            result = fn()
        between()
        ops, last = rec.ops, rec.index[id(result)]
        out = result.clone()
        self.captured += 1

        def replay():
            env: dict[int, torch.Tensor] = {}

            def value(a):
                return env[a.index] if isinstance(a, _Ref) else a

            for func, args, kwargs, outs in ops:
                args, kwargs = tree_map(value, (args, kwargs), is_leaf=lambda a: isinstance(a, _Ref))
                res = func(*args, **kwargs)
                for i, t in zip(outs, tree_flatten(res)[0]):
                    if i is not None:
                        env[i] = t
            out.copy_(env[last])
            self.replays += 1

        return replay, out
