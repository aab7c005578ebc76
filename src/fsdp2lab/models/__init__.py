"""Model registry: ``--model NAME`` -> the :class:`~fsdp2lab.models.spec.ModelSpec` its file declares.

A built-in model is one file that defines the module and its ``SPEC`` (build, units, TP plan,
pipeline); adding one means adding its file and its line below. Your own model needs no line
here: ``--model file.py:NAME`` (:mod:`fsdp2lab.models.user`).
"""

from __future__ import annotations

from fsdp2lab.config import is_reference
from fsdp2lab.errors import UsageError
from fsdp2lab.models import cifar_cnn, gpt, hf, mlp, mnist_cnn
from fsdp2lab.models.spec import ModelSpec
from fsdp2lab.models.user import load_spec

MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (mnist_cnn.SPEC, mlp.SIMPLE_NN, mlp.MLP2_SPEC, cifar_cnn.SPEC, gpt.SPEC)
}


def get_spec(name: str, cfg=None) -> ModelSpec:
    """A built-in model's spec, a pretrained one's (``hf:PATH``), or your model's
    (``module:NAME`` / ``file.py:NAME``; needs ``cfg``)."""
    if hf.is_hf(name):
        return hf.spec(name, cfg)
    if is_reference("model", name):
        return load_spec(name, cfg)
    if name not in MODELS:
        raise UsageError(f"unknown model {name!r}; choose one of: {', '.join(MODELS)}")
    return MODELS[name]
