"""Per-layer low-rank directions: the perturbations of SubZero and LOZO, as their code draws them.

A direction ``z [d]`` over a :class:`~szo.zo.space.ParamSpace` is built parameter by parameter:

* a parameter that is a matrix once its size-1 dimensions are dropped (``torch.squeeze``: a linear
  weight ``[m, n]``, a 1x1 convolution ``[m, n, 1, 1]``) gets a low-rank block ``Z_l [m, n]``:

  - ``form="subzero"`` (Yu et al. 2024, ``large_models/trainer.py``, ``zo_subspace_perturb_parameters``):
    ``Z_l = sqrt(m n / r^2) U_l S_l V_l^T`` with ``U_l [m, r]`` and ``V_l [n, r]`` the Q factors of
    ``torch.linalg.qr`` of Gaussian matrices (``fast_svd_method_v2``), kept between redraws, and a fresh
    Gaussian core ``S_l [r, r]`` every step; the factor makes ``E |Z_l|_F^2 = m n``, a Gaussian
    matrix's. ``r`` is clamped to ``min(r, m, n)`` (the code's QR cannot give more columns);
  - ``form="lozo"`` (Chen et al. 2024, ``LOZOtrainer.py``, ``lowrank_zo_perturb_parameters``):
    ``Z_l = U_l V_l^T`` with ``V_l [n, r]`` Gaussian, kept between redraws, and ``U_l [m, r]`` Gaussian
    and fresh every step (no QR, no factor);

* every other parameter -- biases, norms' scales, neurons' time constants, 3x3 convolution kernels --
  gets a dense Gaussian block of its own shape (the full space), as both codes do for non-matrix
  parameters. SubZero's code tests ``torch.squeeze(p).dim() == 2``, which sends a 4-D ``k x k``
  kernel (``k > 1``) to the full space; LOZO's tests ``p.dim() >= 2`` and has no rule for a 4-D kernel
  (its ``u @ v.T`` is ``[out, in]`` and does not fit ``[out, in, kh, kw]``: its models are
  transformers), so both forms here use SubZero's rule.

Draw order (the run's generator, so a checkpointed generator resumes the same directions): a
redraw (:meth:`LayerFactors.draw_bases`) takes, parameter by parameter, ``U_l`` then ``V_l``
(SubZero) or ``V_l`` (LOZO); a step's draw (:meth:`LayerFactors.draw_cores`) takes, parameter by
parameter, ``S_l`` / ``U_l`` for a low-rank parameter and the dense block for every other one.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

__all__ = ["LOWRANK_FORMS", "LayerFactors", "matrix_shape"]

LOWRANK_FORMS: tuple[str, ...] = ("subzero", "lozo")


def matrix_shape(p: torch.Tensor) -> tuple[int, int] | None:
    """``(m, n)`` of a parameter that is a matrix once its size-1 dimensions are dropped, else None."""
    dims = [int(s) for s in p.shape if s != 1]
    return (dims[0], dims[1]) if len(dims) == 2 else None


class LayerFactors:
    """Which parameters are low-rank, their ranks, and the draws of one form (module docstring)."""

    def __init__(self, params: Sequence[torch.Tensor], rank: int, form: str):
        if form not in LOWRANK_FORMS:
            raise ValueError(f"unknown low-rank form {form!r}; valid: {', '.join(LOWRANK_FORMS)}")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be an int >= 1 (the r of each layer's low-rank perturbation), got {rank!r}")
        self.form, self.rank = form, rank
        self.shapes = [tuple(p.shape) for p in params]
        self.matrices = [matrix_shape(p) for p in params]
        self.ranks = [None if mn is None else (min(rank, *mn) if form == "subzero" else rank) for mn in self.matrices]

    @property
    def low_rank(self) -> list[bool]:
        return [r is not None for r in self.ranks]

    def draw_bases(self, generator: torch.Generator, dtype: torch.dtype) -> list[tuple[torch.Tensor | None, torch.Tensor] | None]:
        """A redraw: ``(U_l, V_l)`` (SubZero, orthonormal columns) or ``(None, V_l)`` (LOZO) per
        low-rank parameter, None for a full-space one."""
        out: list[tuple[torch.Tensor | None, torch.Tensor] | None] = []
        for mn, r in zip(self.matrices, self.ranks):
            if r is None:
                out.append(None)
            elif self.form == "subzero":
                U = torch.linalg.qr(torch.randn(mn[0], r, generator=generator, dtype=dtype))[0]
                V = torch.linalg.qr(torch.randn(mn[1], r, generator=generator, dtype=dtype))[0]
                out.append((U.contiguous(), V.contiguous()))
            else:
                out.append((None, torch.randn(mn[1], r, generator=generator, dtype=dtype)))
        return out

    def draw_cores(self, generator: torch.Generator, dtype: torch.dtype) -> list[torch.Tensor]:
        """One step's fresh draws: ``S_l [r, r]`` (SubZero) / ``U_l [m, r]`` (LOZO) per low-rank
        parameter, a dense Gaussian block of its shape per full-space one."""
        out = []
        for shape, mn, r in zip(self.shapes, self.matrices, self.ranks):
            if r is None:
                out.append(torch.randn(shape, generator=generator, dtype=dtype))
            elif self.form == "subzero":
                out.append(torch.randn(r, r, generator=generator, dtype=dtype))
            else:
                out.append(torch.randn(mn[0], r, generator=generator, dtype=dtype))
        return out

    def block(self, i: int, base: tuple[torch.Tensor | None, torch.Tensor] | None, core: torch.Tensor) -> torch.Tensor:
        """Parameter ``i``'s block of the direction, flat: ``sqrt(m n / r^2) U S V^T`` (SubZero), ``U V^T``
        (LOZO), the dense draw itself (full space)."""
        if base is None:
            return core.reshape(-1)
        U, V = base
        if self.form == "subzero":
            m, n = self.matrices[i]
            r = self.ranks[i]
            return (U @ core @ V.t() * math.sqrt(m * n / (r * r))).reshape(-1)
        return (core @ V.t()).reshape(-1)

    def direction(self, bases, cores) -> torch.Tensor:
        """The flat direction ``z [d]`` (the parameters' order) of one step."""
        return torch.cat([self.block(i, b, c) for i, (b, c) in enumerate(zip(bases, cores))])
