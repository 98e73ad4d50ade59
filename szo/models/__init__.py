"""Model zoo: ``create(name, ...)``, ``names()``, ``register_model``, ``SpikingModel``."""

from szo.models.base import SpikingModel
from szo.models.foreign import ForeignModel
from szo.models.neurons import make_neuron
from szo.models.registry import check_name, create, names, register_model

# imported for their @register_model side effect
from szo.models import convnet, snn_mlp, spike_resnet, spike_vgg  # noqa: E402,F401  isort: skip

__all__ = ["SpikingModel", "ForeignModel", "check_name", "create", "make_neuron", "names", "register_model"]
