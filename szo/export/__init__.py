"""Deployment exchange: szo models <-> NIR graphs (``szo export`` / ``szo import``).

``to_nir(model, input_shape)`` / ``write_nir(graph, path)`` (:mod:`szo.export.nir_export`) and
``read_nir(path)`` / ``from_nir(graph_or_path)`` (:mod:`szo.export.nir_import`; how an imported
graph's edges, cycles included, run: :mod:`szo.export.nir_graph`);
``szo.export.simulators`` runs an exported graph in snnTorch. Needs the ``deploy`` extra
(``nir``, ``nirtorch``, ``snntorch``, ``neurobench``). See docs/deploy.md.
"""
from szo.export.nir_common import DEFAULT_DT, FORMAT
from szo.export.nir_export import to_nir, write_nir
from szo.export.nir_import import NIRNetwork, from_nir, read_nir

__all__ = ["DEFAULT_DT", "FORMAT", "NIRNetwork", "from_nir", "read_nir", "to_nir", "write_nir"]
