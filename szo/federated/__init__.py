"""Forward-only federated training: BAFFLE (seed 002) on Flower.

``szo.federated.baffle``: the math (seeds, loss differences, Stein's estimate, SecAgg+ ranges);
``szo.federated.flower``: the engine (Flower ServerApp with SecAgg+, ClientApps in client processes);
``szo.federated.grid``: the loopback transport between them;
``szo federated RECIPE --clients 8`` runs it (see docs/federated.md).
"""
from szo.federated.baffle import dirichlet_split, round_directions, stein_coordinates, weighted_mean

__all__ = ["dirichlet_split", "round_directions", "stein_coordinates", "weighted_mean"]
