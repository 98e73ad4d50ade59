"""AsyncFGD (seed 001, Algorithm 1): module-wise asynchronous forward-gradient pipeline on torch.distributed.

The network is cut into K consecutive stages, one process per stage (gloo on CPU, NCCL
on GPUs). The pipeline is clocked: at tick t, stage k runs the forward-mode (JVP) pass of
micro-batch ``i = t - k`` on the activation and activation tangent that stage k-1 sent at
tick t-1, with its own seeded parameter tangent ``u_k(i)``, and sends its output and output
tangent on (point-to-point). The last stage turns them into the loss and its directional
derivative ``d_i = grad L . u(i)``; that one scalar is broadcast at the end of the tick and
every stage applies ``w_k <- w_k - lr * d_i * u_k(i)``, regenerating ``u_k(i)`` from its seed
(the paper's "tangent checkpoint": no tangent is stored).

So all K stages compute at once, on K different micro-batches, and stage k of micro-batch i
runs with the parameters after the updates of micro-batches ``0 .. i + k - K`` only: a
staleness of ``K - 1 - k`` updates, decreasing to 0 for the last stage (paper Sec. 4,
``g(k) = K - 1 - k``). ``K = 1`` is vanilla forward gradient descent. Only activations and
their tangents cross between neighbours, and one scalar per micro-batch is broadcast.

``reference_async_fgd`` computes the same iterates in one process straight from that
staleness rule (the test oracle); ``run_stage`` is what each process runs;
``bench/asyncfgd.py`` measures the speed-up over the synchronous (K = 1) run.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
import torch.autograd.forward_ad as fwAD
import torch.distributed as dist
from spikingjelly.activation_based import functional as sjf
from torch import nn
from torch.func import functional_call

from .models.forward_mode import jvp_neurons

__all__ = ["split_stages", "stage_tangent", "run_stage", "reference_async_fgd", "stage_versions", "gather_stages"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]  # activation dtypes sent between stages


def split_stages(layers: Sequence[nn.Module] | nn.Module, K: int) -> list[nn.Sequential]:
    """Cut a chain of layers (a list, or a module whose children run in order) into K stages
    with parameter counts as even as possible; every stage holds at least one layer."""
    mods = list(layers.children()) if isinstance(layers, nn.Module) else list(layers)
    if isinstance(K, bool) or not isinstance(K, int) or not 1 <= K <= len(mods):
        raise ValueError(f"K (stages) must be an integer in [1, {len(mods)}] (the number of layers), got {K!r}")
    sizes = [sum(p.numel() for p in m.parameters()) for m in mods]
    total = max(1, sum(sizes))
    stages, cur, acc = [], [], 0
    for j, (m, s) in enumerate(zip(mods, sizes)):
        cur.append(m)
        acc += s
        left_layers, left_stages = len(mods) - j - 1, K - len(stages) - 1
        if left_stages > 0 and (acc >= total * (len(stages) + 1) / K or left_layers == left_stages):
            stages.append(nn.Sequential(*cur))
            cur = []
    stages.append(nn.Sequential(*cur))
    if len(stages) != K or any(len(s) == 0 for s in stages):
        raise ValueError(f"could not cut {len(mods)} layers into {K} non-empty stages")
    return stages


def stage_tangent(stage: nn.Module, seed: int, i: int, k: int) -> dict[str, torch.Tensor]:
    """``u_k(i)``: N(0, I) over stage k's parameters for micro-batch i, from the seed (tangent checkpoint)."""
    state = np.random.SeedSequence([int(seed), int(i), int(k)]).generate_state(2, dtype=np.uint32)
    g = torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))
    return {n: torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device) for n, p in stage.named_parameters()}


def _jvp_stage(stage: nn.Module, a: torch.Tensor, da: torch.Tensor, u: dict[str, torch.Tensor],
               loss: tuple[LossFn, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage forward with dual inputs and dual parameters: (output, output tangent), or (loss, d loss)."""
    with torch.no_grad(), jvp_neurons(stage), fwAD.dual_level():
        duals = {n: fwAD.make_dual(p.detach(), u[n]) for n, p in stage.named_parameters()}
        out = functional_call(stage, duals, (fwAD.make_dual(a, da),))
        if loss is not None:
            out = loss[0](out, loss[1])
        primal, tangent = fwAD.unpack_dual(out)
        if tangent is None:
            tangent = torch.zeros_like(primal)
        result = primal.clone(), tangent.clone()
    sjf.reset_net(stage)
    return result


@torch.no_grad()
def _update(stage: nn.Module, d: float, u: dict[str, torch.Tensor], lr: float) -> None:
    for n, p in stage.named_parameters():
        p.add_(u[n], alpha=-lr * d)


def stage_versions(i: int, K: int) -> list[int]:
    """How many updates stage k has applied when it runs micro-batch i: ``max(0, i + k - K + 1)``."""
    return [max(0, i + k - K + 1) for k in range(K)]


def run_stage(stage: nn.Module, k: int, K: int, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
              loss_fn: LossFn, *, lr: float, seed: int = 0, encode: Callable[[torch.Tensor], torch.Tensor] | None = None,
              group=None) -> dict:
    """Rank k's part of AsyncFGD over ``batches`` (every rank passes the same list; stage 0 uses x,
    the last stage y). ``encode`` maps x to the first stage's input (e.g. repeat over T).
    Returns ``{"losses": [...], "jvps": [...]}`` (every rank gets the broadcast values)."""
    if not lr >= 0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if K > 1 and not (dist.is_available() and dist.is_initialized()):
        raise ValueError("AsyncFGD with K > 1 needs an initialised torch.distributed process group, one rank per stage")
    if K > 1 and dist.get_world_size(group) != K:
        raise ValueError(f"AsyncFGD runs one process per stage: world size {dist.get_world_size(group)} != K = {K}")
    n = len(batches)
    losses, jvps = [], []
    pending: list = []
    shape_msg = torch.zeros(8, dtype=torch.int64)
    for t in range(n + K - 1):
        i = t - k
        sent = []
        result = None
        if 0 <= i < n:
            x, y = batches[i]
            if k == 0:
                a = encode(x) if encode is not None else x
                da = torch.zeros_like(a)
            else:  # activation + tangent of micro-batch i from stage k-1 (sent at tick t-1)
                dist.recv(shape_msg, src=k - 1, group=group)
                ndim = int(shape_msg[0])
                a = torch.empty([int(s) for s in shape_msg[1 : 1 + ndim]], dtype=_DTYPES[int(shape_msg[7])])
                da = torch.empty_like(a)
                dist.recv(a, src=k - 1, group=group)
                dist.recv(da, src=k - 1, group=group)
            u = stage_tangent(stage, seed, i, k)
            if k == K - 1:
                result = _jvp_stage(stage, a, da, u, loss=(loss_fn, y))
            else:
                out, dout = _jvp_stage(stage, a, da, u)
                if out.dim() > 6 or out.dtype not in _DTYPES:
                    raise ValueError(f"stage {k} output must have <= 6 dims and a float dtype, got shape "
                                     f"{tuple(out.shape)}, {out.dtype}")
                msg = torch.zeros(8, dtype=torch.int64)
                msg[0] = out.dim()
                msg[1 : 1 + out.dim()] = torch.tensor(out.shape)
                msg[7] = _DTYPES.index(out.dtype)
                bufs = [msg, out.contiguous(), dout.contiguous()]  # kept alive until the sends complete
                sent = [(dist.isend(b, dst=k + 1, group=group), b) for b in bufs]
        # end of tick: the last stage's (loss, d) of micro-batch j = t - K + 1 reaches every stage
        j = t - (K - 1)
        if j >= 0:
            box = torch.zeros(2, dtype=torch.float64)
            if k == K - 1 and result is not None:
                box[0], box[1] = float(result[0]), float(result[1])
            if K > 1:
                dist.broadcast(box, src=K - 1, group=group)
            if not torch.isfinite(box).all():
                raise FloatingPointError(f"AsyncFGD: non-finite loss or JVP at micro-batch {j}")
            losses.append(float(box[0]))
            jvps.append(float(box[1]))
            _update(stage, float(box[1]), stage_tangent(stage, seed, j, k), lr)
        for h, _ in pending:
            h.wait()
        pending = sent
    for h, _ in pending:
        h.wait()
    return {"losses": losses, "jvps": jvps}


def gather_stages(stages: Sequence[nn.Module], k: int, K: int, dst: int = 0, group=None) -> None:
    """After ``run_stage``: copy every stage's trained parameters and buffers (BN statistics) into
    rank ``dst``'s copy of the stages, so that rank holds the whole trained model (a collective)."""
    if K == 1:
        return
    for j, s in enumerate(stages):
        tensors = [t for _, t in s.named_parameters()] + [t for _, t in s.named_buffers()]
        for t in tensors:
            if j == k and k != dst:
                dist.send(t.detach().contiguous(), dst=dst, group=group)
            elif j != k and k == dst:
                buf = torch.empty_like(t)
                dist.recv(buf, src=j, group=group)
                with torch.no_grad():
                    t.copy_(buf)


def reference_async_fgd(stages: Sequence[nn.Module], batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                        loss_fn: LossFn, *, lr: float, seed: int = 0,
                        encode: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict:
    """The AsyncFGD iterates in one process from the staleness rule alone (test oracle):
    micro-batch i runs stage k with its parameters after ``stage_versions(i, K)[k]`` updates."""
    K = len(stages)
    history = [[{n: p.detach().clone() for n, p in s.named_parameters()}] for s in stages]
    losses, jvps = [], []
    for i, (x, y) in enumerate(batches):
        a = encode(x) if encode is not None else x
        da = torch.zeros_like(a)
        for k, s in enumerate(stages):
            with torch.no_grad():
                for n, p in s.named_parameters():
                    p.copy_(history[k][stage_versions(i, K)[k]][n])
            u = stage_tangent(s, seed, i, k)
            a, da = _jvp_stage(s, a, da, u, loss=(loss_fn, y) if k == K - 1 else None)
        losses.append(float(a))
        jvps.append(float(da))
        for k, s in enumerate(stages):  # update i: version i + 1 from version i
            new = {n: v.clone() for n, v in history[k][i].items()}
            for n, v in stage_tangent(s, seed, i, k).items():
                new[n].add_(v, alpha=-lr * float(da))
            history[k].append(new)
    with torch.no_grad():
        for k, s in enumerate(stages):
            for n, p in s.named_parameters():
                p.copy_(history[k][-1][n])
    return {"losses": losses, "jvps": jvps}
