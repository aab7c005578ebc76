"""A LoRA run's checkpoint (``--lora-rank``) as PEFT and transformers read it.

A LoRA checkpoint holds the adapters, not the base. Both exports rebuild the run's model on the
meta device from the Hugging Face config the run recorded, with PEFT's ``get_peft_model`` and the
run's own ``LoraConfig`` (``models.lora.lora_config`` of the recorded flags), so every name is the
one PEFT gives it:

- :func:`export_adapter`: a PEFT adapter folder (``adapter_config.json``,
  ``adapter_model.safetensors``) written by PEFT's ``PeftModel.save_pretrained`` from the
  checkpoint's adapters; ``PeftModel.from_pretrained(base, OUT)`` loads it.
- :func:`export_merged`: the base folder the run started from with the adapters merged in, as
  ``save_pretrained`` writes it (config, shards, the recorded tokenizer files): each adapted
  module's weights, read from the base folder in their own dtype, merged by PEFT's own
  ``LoraLayer.merge`` (what ``merge_and_unload`` runs), one module at a time; every other tensor
  copied from the base folder; floating tensors written in the source model's dtype (its config's),
  or ``--save-dtype``'s.

The adapters are written as trained (PEFT keeps them so), or in ``--save-dtype``'s dtype.

Nothing is unpickled: the checkpoint is read through the restricted DCP reader, the base folder
through ``safetensors``. Each folder is written under a temporary name and renamed into place.
"""

from __future__ import annotations

import copy
import dataclasses
import shutil
import warnings
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.nn as nn

from fsdp2lab.checkpoint import layout, targets
from fsdp2lab.checkpoint.safetensors_export import (
    _DTYPES,
    DEFAULT_MAX_SHARD_SIZE,
    Entry,
    Exported,
    _check_out_folder,
    _hf_model_info,
    _Reader,
    load_tensor,
    meta_hf_model,
    model_entries,
    save_dtype,
    saved_as,
    write_export_folder,
)
from fsdp2lab.checkpoint.state import LORA_BASE, lora_base, saved_run
from fsdp2lab.config import TrainConfig
from fsdp2lab.errors import UsageError

_FROM_SAFETENSORS = {code: dtype for dtype, code in _DTYPES.items()}


def is_lora(ckpt: layout.Checkpoint) -> bool:
    """Whether ``ckpt`` was saved by a LoRA run (``--lora-rank``)."""
    return bool((saved_run(ckpt).get("config") or {}).get("lora_rank"))


def _run_config(run: dict) -> TrainConfig:
    """The run's flags as the run resolved them (alpha and targets filled in)."""
    saved = run.get("config") or {}
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in saved.items() if k in names})


def peft_model(run: dict) -> tuple[object, nn.Module]:
    """The run's model on the meta device as PEFT builds it (``get_peft_model`` with the run's
    ``LoraConfig``, a causal LM's task type), and its transformers config."""
    from fsdp2lab.models import lora

    hf_config = run.get("hf_config")
    if not hf_config:
        raise UsageError(
            "a PEFT export needs a Hugging Face model's run (--model hf:PATH); export the "
            "adapters alone to OUT.pt or OUT.safetensors"
        )
    settings = dict(hf_config)
    model_type = settings.pop("model_type", None)
    if not model_type:
        raise UsageError("the Hugging Face config the run recorded has no model_type")
    config, model = meta_hf_model(model_type, settings)
    peft = lora._peft()
    lora_config = lora.lora_config(_run_config(run), model)
    lora_config.task_type = "CAUSAL_LM"
    lora_config.base_model_name_or_path = run.get("hf_source")
    with warnings.catch_warnings():  # transformers' deprecation of a name PEFT still calls
        warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
        return config, peft.get_peft_model(model, lora_config)


def _adapter_entries(ckpt: layout.Checkpoint, model: nn.Module) -> dict[str, Entry]:
    """The checkpoint's adapter tensors by name, checked against ``model``'s (the PEFT model's
    base model: the training model's names)."""
    from fsdp2lab.models.lora import is_adapter

    have = {e.name: e for e in model_entries(ckpt) if is_adapter(e.name)}
    want = {n: tuple(p.shape) for n, p in model.named_parameters() if is_adapter(n)}
    differ = sorted(set(have) ^ set(want)) or sorted(n for n in want if have[n].shape != want[n])
    if differ:
        raise UsageError(
            f"checkpoint {ckpt.path}: its adapters do not fit the run's LoRA model "
            f"({len(differ)} differ, e.g. {differ[0]})"
        )
    return have


def export_adapter(source: str, out: str, dtype: str | None = None) -> Exported:
    """Write the adapters of LoRA checkpoint ``source`` as a PEFT adapter folder ``out``, in
    ``dtype`` (fp32, bf16, fp16; None: as trained)."""
    ckpt = layout.find_checkpoint(source, [])
    run = saved_run(ckpt)
    _, model = peft_model(run)
    base = model.get_base_model()
    found = _adapter_entries(ckpt, base)
    entries = dict(zip(found, saved_as(list(found.values()), save_dtype(dtype, None)), strict=True))
    out_path = Path(out)
    _check_out_folder(out_path, ckpt, run, sum(e.nbytes for e in entries.values()))
    # PEFT's names of the training model's parameters (``base_model.model.`` + the name).
    peft_names = {id(p): n for n, p in model.named_parameters()}
    reader = _Reader(ckpt.path)
    state = {
        peft_names[id(base.get_parameter(name))]: load_tensor(reader, entry).to(entry.out_dtype)
        for name, entry in entries.items()
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = targets.new_folder(out_path)
    try:
        model.save_pretrained(str(tmp), state_dict=state, save_embedding_layers=False)
        (tmp / "README.md").unlink(missing_ok=True)  # PEFT's model card template
        targets.put_in_place(tmp, out_path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = sorted(p for p in out_path.iterdir() if p.name != targets.MARK)
    total = sum(e.nbytes for e in entries.values())
    return Exported(ckpt, files, len(entries), total)


def base_folder(run: dict) -> Path:
    """The pretrained folder the run started from (``--model hf:PATH``), checked against the
    fingerprint the checkpoint records: the adapters were trained on exactly those weights."""
    saved = run.get(LORA_BASE) or {}
    source = saved.get("folder")
    if not source or not Path(source).is_dir():
        where = source or "none recorded: a model built from the seed"
        raise UsageError(f"--merge needs the base model's folder the run started from ({where})")
    here = lora_base(source)
    if here is None or here["sha256"] != saved.get("sha256"):
        raise UsageError(
            f"--merge: the base folder {source} changed since the run (its fingerprint differs "
            "from the one the checkpoint records): its adapters were trained on other weights"
        )
    return Path(source)


def export_merged(
    source: str, out: str, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE, dtype: str | None = None
) -> Exported:
    """Write the base folder of LoRA checkpoint ``source``'s run with the adapters merged in, as
    a ``save_pretrained`` folder ``out``, floating tensors in ``dtype`` (fp32, bf16, fp16), else
    in the source model's (:func:`save_dtype`)."""
    from fsdp2lab.models.hf_weights import WeightIndex
    from fsdp2lab.models.lora import base_key, is_adapter, lora_layers

    ckpt = layout.find_checkpoint(source, [])
    run = saved_run(ckpt)
    _, model = peft_model(run)
    base = model.get_base_model()
    adapters = _adapter_entries(ckpt, base)
    folder = base_folder(run)
    index = WeightIndex.read(folder)
    if index is None:
        raise UsageError(
            f"--merge: {folder} holds no safetensors weights (the run's base was built from the "
            "seed): nothing to merge into"
        )
    entries = [
        Entry(key, key, index.shapes[key], _FROM_SAFETENSORS[index.dtypes[key]])
        for key in index.files
        if index.dtypes[key] in _FROM_SAFETENSORS
    ]
    entries = saved_as(entries, save_dtype(dtype, run["hf_config"]))
    config, tied = _hf_model_info(run["hf_config"], entries)
    # Each adapted module's base tensors by their name in the files.
    adapted: dict[str, tuple[str, nn.Module]] = {}
    for fqn, layer in lora_layers(base):
        for pname, _ in layer.named_parameters():
            if not is_adapter(pname):
                adapted[base_key(f"{fqn}.{pname}")] = (fqn, layer)
    reader = _Reader(ckpt.path)
    with ExitStack() as stack:
        from safetensors import safe_open

        opened: dict[str, object] = {}

        def base_tensor(key: str) -> torch.Tensor:
            name = index.files[key]
            if name not in opened:
                opened[name] = stack.enter_context(safe_open(folder / name, framework="pt"))
            return opened[name].get_tensor(key)

        def load(entry: Entry) -> torch.Tensor:
            if entry.name not in adapted:
                return base_tensor(entry.name)
            fqn, layer = adapted[entry.name]
            layer = copy.deepcopy(layer).to_empty(device="cpu")  # filled, merged, dropped
            for pname, param in layer.named_parameters():
                full = f"{fqn}.{pname}"
                param.data = (
                    load_tensor(reader, adapters[full])
                    if is_adapter(pname)
                    else base_tensor(base_key(full))
                )
            layer.merge()
            return layer.get_base_layer().get_parameter(entry.name.removeprefix(f"{fqn}."))

        kept = [e for e in entries if e.name not in tied]
        files, total = write_export_folder(Path(out), ckpt, kept, load, config, max_shard_size)
    return Exported(ckpt, files, len(kept), total, tied)
