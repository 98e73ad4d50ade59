"""Forward-only federated training: BAFFLE (seed 002) on Flower.

``szo.federated.baffle``: the math (seeds, loss differences, zero-sum masks, Stein's estimate);
``szo.federated.flower``: the engine (Flower server strategy + client processes over gRPC);
``szo federated RECIPE --clients 8`` runs it (see docs/federated.md).
"""
from szo.federated.baffle import aggregate, dirichlet_split, pairwise_masks, round_directions, stein_coordinates

__all__ = ["aggregate", "dirichlet_split", "pairwise_masks", "round_directions", "stein_coordinates"]
