"""LoRA adapters on a frozen base (``--lora-rank R``), built with PEFT.

The adapters are inserted in place with PEFT's ``inject_adapter_in_model`` (not ``get_peft_model``):
the root and every module name stay the model's own, so the sharding units, the TP plan, the
pipeline split and the pretrained weights' names apply unchanged; an adapted linear ``q_proj``
becomes PEFT's ``LoraLayer`` holding ``q_proj.base_layer`` (the frozen weight) and
``q_proj.lora_A.default`` / ``q_proj.lora_B.default`` (the adapters), exactly as in a
``PeftModel``'s ``base_model.model``. It is applied on the meta model the plan builds, so the
strategies shard the adapters with the layer that holds them (``fully_shard`` per decoder layer).

* :func:`lora_config` -- the ``peft.LoraConfig`` of ``cfg``: rank, alpha (default 2 x rank),
  dropout, the target module names (``--lora-targets``; default for a Hugging Face model: every
  linear module but the output head, e.g. ``q_proj,...,down_proj`` for Llama).
* :func:`apply_lora` -- inject the adapters, each eligible adapted linear fused into one autograd
  Function (:mod:`~fsdp2lab.models.lora_fused`); every other parameter is frozen (no gradient, no
  optimizer state) and cast to ``base_dtype`` if given. UsageError (one line) when PEFT is missing
  or the targets match no module (listing the model's linear modules).
* :func:`init_adapters` -- PEFT's own adapter init (A: kaiming uniform, B: zeros), seeded per
  module as :mod:`~fsdp2lab.models.materialize` seeds the others, copied into each rank's shards.
* :func:`trainable_state` -- ``{name: parameter}`` of the adapters (what training changes).
* :func:`base_key` -- a parameter's name in the base model's files (``base_layer.`` removed).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from pathlib import Path

import torch
import torch.nn as nn

from fsdp2lab.errors import UsageError
from fsdp2lab.models.hf_weights import WeightIndex
from fsdp2lab.models.hf_weights import base_key as base_key  # the files' name of a base tensor
from fsdp2lab.models.materialize import _copy_into, _lookup, module_seed

ADAPTER = "default"  # PEFT's adapter name
INSTALL = "pip install -e '.[hf]'"


def _peft():
    try:
        import peft
    except ImportError:
        raise UsageError(f"--lora-rank needs PEFT, which is not installed ({INSTALL})") from None
    return peft


def linear_names(model: nn.Module) -> list[str]:
    """The last name component of every linear module, deduplicated, in model order."""
    names = [n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    return list(dict.fromkeys(names))


def default_targets(model: nn.Module) -> list[str] | None:
    """A Hugging Face model's linear modules but its output head (for Llama, Mistral, Qwen: the
    attention and MLP projections); None for another model (it must name its targets)."""
    if not hasattr(model, "get_output_embeddings"):
        return None
    head = model.get_output_embeddings()
    names = [
        n.rsplit(".", 1)[-1]
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and m is not head
    ]
    return list(dict.fromkeys(names))


def targets(cfg, model: nn.Module) -> list[str]:
    """``--lora-targets`` as a list, or the model's default; UsageError when a name matches no
    linear module (PEFT matches a name against a module's full name or its ``.``-suffix)."""
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    available = ", ".join(linear_names(model)) or "none"
    if cfg.lora_targets:
        names = [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]
    else:
        names = default_targets(model)
        if names is None:
            raise UsageError(
                f"--lora-rank on model {cfg.model!r} needs --lora-targets NAMES (its linear "
                f"modules: {available})"
            )
    unmatched = [t for t in names if not any(n == t or n.endswith(f".{t}") for n in linears)]
    if not names or unmatched:
        raise UsageError(
            f"--lora-targets {','.join(unmatched) or repr(cfg.lora_targets)} matches no linear "
            f"module of the model (its linear modules: {available})"
        )
    return names


def lora_config(cfg, model: nn.Module):
    """PEFT's ``LoraConfig`` for ``cfg`` on ``model``."""
    peft = _peft()
    rank = cfg.lora_rank
    return peft.LoraConfig(
        r=rank,
        lora_alpha=cfg.lora_alpha if cfg.lora_alpha is not None else 2 * rank,
        lora_dropout=cfg.lora_dropout,
        target_modules=targets(cfg, model),
        bias="none",
        init_lora_weights=True,
    )


def apply_lora(model: nn.Module, cfg, base_dtype: torch.dtype | None = None) -> nn.Module:
    """Inject LoRA adapters into ``model`` in place (on its device: meta for the plan's model) and
    return it: adapters fp32 and trainable, everything else frozen, floating-point base tensors
    in ``base_dtype`` (None: as they are); each eligible adapted linear runs one fused autograd
    Function (:mod:`~fsdp2lab.models.lora_fused`)."""
    peft = _peft()
    from fsdp2lab.models.lora_fused import fuse

    config = lora_config(cfg, model)
    device = next(model.parameters()).device
    with torch.device(device):
        model = peft.inject_adapter_in_model(config, model, low_cpu_mem_usage=device.type == "meta")
    fuse(model)
    for name, param in model.named_parameters():
        adapter = is_adapter(name)
        param.requires_grad_(adapter)
        dtype = torch.float32 if adapter else base_dtype
        if dtype is not None and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
    return model


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` is a LoRA adapter's."""
    return any(part.startswith("lora_") for part in name.split("."))


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' parameters by name (the model's parameter names, wrappers' prefixes and
    all): what LoRA training changes."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The adapted modules (PEFT ``LoraLayer``s): (name, module)."""
    from peft.tuners.lora import LoraLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]


def init_adapters(model: nn.Module, reference: nn.Module, seed: int) -> None:
    """PEFT's initialisation of each adapter of ``reference`` (the meta model), on CPU from a
    generator seeded by (seed, module name), copied into the part of ``model`` each rank holds
    (a stage holds some): the same initial adapters for every strategy and world size."""
    for fqn, layer in lora_layers(reference):
        pairs = [(layer.lora_A[ADAPTER], "lora_A"), (layer.lora_B[ADAPTER], "lora_B")]
        names = [
            f"{fqn}.{kind}.{ADAPTER}.{n}" for sub, kind in pairs for n, _ in sub.named_parameters()
        ]
        targets = {n: _lookup(model, n) for n in names}
        if all(t is None for t in targets.values()):
            continue
        saved = [(sub, dict(sub._parameters)) for sub, _ in pairs]
        try:
            for sub, _ in pairs:
                sub.to_empty(device="cpu")
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(module_seed(seed, fqn))
                with torch.no_grad():
                    layer.reset_lora_parameters(ADAPTER, True)
            full = dict(zip(names, (p for sub, _ in pairs for p in sub.parameters()), strict=True))
            for name, target in targets.items():
                if target is not None:
                    _copy_into(target, full[name])
        finally:
            for sub, params in saved:
                sub._parameters.update(params)


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def base_dtype(cfg, source: str | None) -> torch.dtype:
    """The frozen base's storage dtype: the folder's floating dtype (its weight files', else its
    config's ``dtype``) where the compute dtype is that dtype (a bf16 folder trained in bf16 keeps a bf16 base: no fp32 copy), else fp32 (also
    under ``--strategy fsdp1``, whose flat parameters hold one dtype, the adapters' fp32)."""
    if source is None or cfg.strategy == "fsdp1":
        return torch.float32
    index = WeightIndex.read(Path(source))
    if index:
        stored = {_SAFETENSORS_DTYPES.get(d) for d in index.dtypes.values()}
    else:  # a folder with only config.json (e.g. to plan): the dtype its config names
        config = json.loads((Path(source) / "config.json").read_text())
        stored = {getattr(torch, str(config.get("dtype") or config.get("torch_dtype")), None)}
    stored.discard(None)
    compute = COMPUTE_DTYPES[cfg.mixed_precision]
    return compute if stored == {compute} else torch.float32


def with_adapters(load_weights, seed: int):
    """A ``ModelSpec.load_weights`` that reads (or seeds) the base as ``load_weights`` does (None:
    the seeded init), then initialises the adapters (:func:`init_adapters`)."""
    from fsdp2lab.models.materialize import init_weights

    def load(model: nn.Module, reference: nn.Module) -> None:
        if load_weights is not None:
            load_weights(model, reference)
        else:
            init_weights(model, reference, seed)
        init_adapters(model, reference, seed)

    return load


def check(cfg) -> None:
    """What LoRA refuses before the model is built: UsageError, one line."""
    _peft()
    if cfg.strategy == "model-parallel":
        raise UsageError(
            "--lora-rank works with --strategy fsdp2, fsdp1, ddp and single, not model-parallel"
        )
    if cfg.tp > 1 or cfg.pp > 1:
        raise UsageError(
            "--lora-rank with --tp/--pp: PEFT's LoRA layers replace the linear modules the TP "
            "plan shards and the pipeline split names; use data parallelism (FSDP2, HSDP, DDP)"
        )


@functools.lru_cache(maxsize=8)
def fingerprint(source: str) -> str:
    """sha256 of a base folder's ``config.json`` and of each weight file's sha256 (a file in the
    Hugging Face cache is a link to a blob named by its content's sha256: read from the name;
    another file is hashed, once per process): two folders with the same weights agree, a
    folder whose weights differ in any byte does not."""
    folder = Path(source)
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    index = WeightIndex.read(folder)
    for name in sorted(set(index.files.values())) if index else []:
        digest.update(f"\0{name}\0{_file_sha256(folder / name)}".encode())
    return digest.hexdigest()


def _file_sha256(path) -> str:
    blob = path.resolve()
    if (
        path.is_symlink()
        and blob.parent.name == "blobs"
        and re.fullmatch(r"[0-9a-f]{64}", blob.name)
    ):
        return blob.name
    digest = hashlib.sha256()
    with open(blob, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()
