"""``--quantize-base nf4``: QLoRA's frozen base, its decoder layers' linear weights in torchao's NF4.

Every frozen ``nn.Linear`` weight inside the sharding units (the decoder layers: attention and
MLP projections, PEFT's ``base_layer`` under an adapter) becomes a torchao ``NF4Tensor`` with
torchao's defaults: absmax blocks of ``BLOCK`` = 64 values, each block's scale double-quantized to
int8 in blocks of ``SCALER_BLOCK`` = 256 scales (less their mean). Embeddings, norms, biases and
the output head stay in the base's dtype; the LoRA adapters stay fp32 and trainable.

Under FSDP2 (HSDP too) the weights are made NF4 on the meta device (:func:`before_sharding`),
so FSDP2 shards each by rows with torchao's own split and all-gathers its NF4 parts
(``NF4Tensor.fsdp_pre/post_all_gather``). Each rank then reads only its rows of the source (an
``hf:`` folder's slices, or its part of a seeded module's weights) and quantizes them into its
shard (``nf4.quantize_into``), bit for bit the shard of ``to_nf4`` of the whole weight: so no rank
holds more than one whole weight at a time. On one shard rank FSDP2 would hand a layer only the
first of NF4's parts (its one-rank path skips the all-gather): there it leaves the base whole
(``RunPlan.unsharded``, FSDP2's ``ignored_params``), made NF4 in the compute dtype, as FSDP2's
all-gather would have cast it. ``--strategy single`` quantizes the loaded weights whole
(:func:`after_load`).

Checkpoints (``--ckpt-dir``, ``--resume``) hold the adapters and their optimizer state, never the
NF4 base, and in the run info the base's quantization (:func:`record`). On resume the base is
loaded and quantized as in a fresh run; a checkpoint whose record differs (another scheme or block
sizes, another source folder or seed, or no quantization) is refused in one line
(``checkpoint.state.check_base``). Resume is exact at the same layout and continues at another
world size, e.g. saved on 2 ranks, resumed in one process::

    fsdp2lab train --model hf:DIR --lora-rank 16 --quantize-base nf4 --ckpt-dir ckpt --nproc-per-node 2
    fsdp2lab train --model hf:DIR --lora-rank 16 --quantize-base nf4 --resume ckpt \
        --strategy single --nproc-per-node 1

* :func:`check` -- what ``--quantize-base`` refuses before any worker starts (one line): other
  strategies than ``fsdp2`` (HSDP too) and ``single``, ``--tp``, ``--pp``, ``--save-model``,
  ``--activation-checkpointing op``.
* :func:`check_sizes` -- each quantized weight splits into whole NF4 blocks on every shard;
  ``--cpu-offload`` needs 2 or more shard ranks (on one the base stays whole on the device).
* :func:`base_linears` -- the linear modules whose weights become NF4.
* :func:`before_sharding` -- a strategy's ``parallelize`` that quantizes the meta model first.
* :func:`after_load` -- a ``ModelSpec.load_weights`` that loads the base, then quantizes it.
* :func:`record`, :func:`describe` -- a checkpoint's record of the quantized base, and in words.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from fsdp2lab.errors import UsageError
from fsdp2lab.models.lora import COMPUTE_DTYPES, is_adapter
from fsdp2lab.models.nf4 import BLOCK, SCALER_BLOCK, VALUES_PER_SCALER_BLOCK, nf4_api

# Flags (config field -> is it set) whose code paths do not handle NF4 weights yet.
_NOT_YET = {
    "save_model": "--save-model",
}
STRATEGIES = ("fsdp2", "single")


def check(cfg) -> None:
    """What ``--quantize-base`` refuses before the model is built: UsageError, one line."""
    nf4_api()
    if cfg.strategy not in STRATEGIES or cfg.tp > 1 or cfg.pp > 1:
        layout = "--tp" if cfg.tp > 1 else "--pp" if cfg.pp > 1 else f"--strategy {cfg.strategy}"
        raise UsageError(
            f"--quantize-base does not support {layout} yet: use --strategy fsdp2 (HSDP too) "
            "or single"
        )
    if cfg.activation_checkpointing == "op":  # its cache of saved outputs sees NF4 mutated
        raise UsageError(
            "--quantize-base does not support --activation-checkpointing op yet: use full or "
            "selective"
        )
    unsupported = [flag for name, flag in _NOT_YET.items() if getattr(cfg, name)]
    if unsupported:
        raise UsageError(f"--quantize-base does not support {', '.join(unsupported)} yet")


def base_linears(model: nn.Module, units: tuple[str, ...]) -> list[tuple[str, nn.Linear]]:
    """The frozen linear modules (not LoRA's own) inside the sharding units: (name, module)."""
    found = []
    for unit in units:
        for name, module in model.get_submodule(unit).named_modules(prefix=unit):
            if (
                isinstance(module, nn.Linear)
                and not is_adapter(name)
                and not module.weight.requires_grad
            ):
                found.append((name, module))
    return found


def check_sizes(model: nn.Module, units: tuple[str, ...], shards: int, cfg) -> None:
    """Each quantized weight must split into whole double-quantization blocks on each of the
    ``shards`` ranks FSDP2 shards it over (torchao's NF4 split): UsageError naming the first
    weight that does not, and the sizes that would. On one shard rank FSDP2 leaves the NF4 base
    whole (``RunPlan.unsharded``), so it cannot offload it: ``--cpu-offload`` is refused."""
    if cfg.strategy == "fsdp2" and shards == 1 and cfg.cpu_offload:
        raise UsageError(
            "--quantize-base nf4 with --cpu-offload needs 2 or more ranks to shard over (on one "
            "the NF4 base stays on the GPU, whole)"
        )
    linears = base_linears(model, units)
    if not linears:
        raise UsageError("--quantize-base: the model's layers hold no frozen nn.Linear to quantize")
    per_weight = VALUES_PER_SCALER_BLOCK * shards
    for name, module in linears:
        rows, cols = module.weight.shape
        if rows % shards or (rows * cols) % per_weight:
            over = f" over {shards} ranks" if shards > 1 else ""
            raise UsageError(
                f"--quantize-base nf4: {name}.weight {rows} x {cols} does not split into whole "
                f"NF4 blocks{over}: its size must be a multiple of {BLOCK} x {SCALER_BLOCK} x "
                f"{shards} = {per_weight:,} values (and its rows of {shards})"
            )


def quantize_base(
    model: nn.Module, units: tuple[str, ...], dtype: torch.dtype | None = None
) -> None:
    """Replace each :func:`base_linears` weight of ``model`` by its NF4 (dequantizing to
    ``dtype``, default the weight's). On the meta device (shapes only) one ``to_nf4`` per shape
    and dtype: the other weights of that shape are ``empty_like`` it (torchao quantizes a 70B
    projection's meta weight in chunks, about 0.1 s each)."""
    _, to_nf4 = nf4_api()
    on_meta: dict[tuple, torch.Tensor] = {}
    for _, module in base_linears(model, units):
        weight = module.weight.detach().to(dtype or module.weight.dtype)
        if weight.is_meta:
            key = (weight.shape, weight.dtype)
            if key not in on_meta:
                on_meta[key] = to_nf4(weight, BLOCK, SCALER_BLOCK)
            nf4 = torch.empty_like(on_meta[key])
        else:
            nf4 = to_nf4(weight, BLOCK, SCALER_BLOCK)
        module.weight = nn.Parameter(nf4, requires_grad=False)


def before_sharding(parallelize, units: tuple[str, ...]):
    """A strategy's ``parallelize`` that first makes the (meta) model's base weights NF4
    (:func:`quantize_base`: shapes only), so FSDP2 shards NF4 weights; each rank's shard is
    filled when the weights are loaded (``nf4.quantize_into``)."""

    def parallelize_nf4(model: nn.Module, plan, mesh, device) -> nn.Module:
        # a base FSDP2 leaves whole is not cast by it: made NF4 in the compute dtype
        whole = plan.unsharded and plan.cfg.mixed_precision != "fp32"
        quantize_base(model, units, COMPUTE_DTYPES[plan.cfg.mixed_precision] if whole else None)
        return parallelize(model, plan, mesh, device)

    return parallelize_nf4


def after_load(load_weights, units: tuple[str, ...]):
    """A ``ModelSpec.load_weights`` that loads the base (and adapters) as ``load_weights`` does,
    then quantizes the base (:func:`quantize_base`)."""

    def load(model: nn.Module, reference: nn.Module) -> None:
        load_weights(model, reference)
        quantize_base(model, units)

    return load


def record(scheme: str, source: dict | None, seed: int) -> dict:
    """A checkpoint's record of the quantized base: the scheme, its block sizes, and its source
    (``source``: the folder and its fingerprint, ``checkpoint.state.lora_base``; None: a model
    built from ``seed``)."""
    origin = source if source is not None else {"seed": seed}
    return {"scheme": scheme, "block": BLOCK, "scaler_block": SCALER_BLOCK, "source": origin}


def describe(saved: dict | None) -> str:
    """A :func:`record` in words (None: an unquantized base)."""
    if saved is None:
        return "an unquantized base (no --quantize-base)"
    source = saved.get("source") or {}
    if "folder" in source:
        origin = f"{source['folder']} (fingerprint {str(source.get('sha256'))[:12]})"
    else:
        origin = f"the model built from seed {source.get('seed')}"
    return (
        f"an {saved.get('scheme')} base (blocks of {saved.get('block')}, scales in blocks of "
        f"{saved.get('scaler_block')}) of {origin}"
    )
