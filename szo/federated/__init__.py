"""Forward-only federated training: BAFFLE (seed 002) on Flower.

``szo.federated.baffle``: the math (seeds, loss differences, Stein's estimate, SecAgg+ ranges);
``szo.federated.flower``: the engine (ClientApps in client processes, the run); ``szo.federated.server``: its
ServerApp with SecAgg+, the update and the upload checks; ``szo.federated.task``: what both build from the recipe;
``szo.federated.grid``: the loopback transport between them;
``szo federated RECIPE --clients 8`` runs it (see docs/federated.md).
"""
from szo.federated.baffle import dirichlet_split, round_directions, stein_coordinates, weighted_mean

__all__ = ["dirichlet_split", "round_directions", "stein_coordinates", "weighted_mean"]
