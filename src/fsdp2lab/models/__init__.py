"""Model registry: ``--model NAME`` -> the :class:`~fsdp2lab.models.spec.ModelSpec` its file declares.

A built-in model is one file that defines the module and its ``SPEC`` (build, units, TP plan,
pipeline); adding one means adding its file and its line below.
"""

from __future__ import annotations

from fsdp2lab.errors import UsageError
from fsdp2lab.models import cifar_cnn, gpt, mlp, mnist_cnn
from fsdp2lab.models.spec import ModelSpec

MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (mnist_cnn.SPEC, mlp.SIMPLE_NN, mlp.MLP2_SPEC, cifar_cnn.SPEC, gpt.SPEC)
}


def get_spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise UsageError(f"unknown model {name!r}; choose one of: {', '.join(MODELS)}")
    return MODELS[name]
