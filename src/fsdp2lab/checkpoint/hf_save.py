"""A Hugging Face model folder written from every rank (``train --save-hf DIR``), no gather.

Every rank hands its own shards of the model's tensors to DCP's ``HuggingFaceStorageWriter``,
in files of groups of tensors no bigger together than the largest one (each rank serialises its
part of one group at a time); rank 0 then joins them into whole-tensor files, one tensor at a
time, in the ``save_pretrained`` layout (``model.safetensors``, or
``model-0000K-of-0000N.safetensors`` and their index above ``max_shard_size``), floating tensors
in the dtype ``--save-dtype`` names, else the source model's (its config's ``dtype``, which
``config.json`` then names; a PEFT adapter folder's adapters: as trained), each file with the
metadata ``{"format": "pt"}``. Beside them: ``config.json`` (tied weights are stored once:
``from_pretrained`` ties them again) and the tokenizer's files and ``generation_config.json`` the
run read, each only while its sha256 is the one recorded at the start of the run (a file that
changed is left out, with a warning). A LoRA run's folder is its PEFT adapter folder instead
(``adapter_config.json``, ``adapter_model.safetensors``: what ``ckpt export`` writes), or with
``--merge`` the model with the adapters merged in (:func:`merged_state`). The folder
is written whole under a temporary name and renamed into place (:mod:`fsdp2lab.checkpoint.targets`:
leftovers of dead saves beside it are tidied first); the folders the run read and a folder
fsdp2lab did not write are refused.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
import threading
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fsdp2lab.checkpoint import layout, targets
from fsdp2lab.checkpoint import state as ckpt_state
from fsdp2lab.checkpoint.safetensors_export import (
    ADAPTER_FILES,
    CONFIG_FILE,
    DEFAULT_MAX_SHARD_SIZE,
    INDEX_FILE,
    SHARDS,
    Entry,
    _hf_model_info,
    check_out_folder,
    companion_sources,
    join_shards,
    pieces,
    plan_shards,
    prepare_out,
    save_dtype,
    saved_as,
    single_file,
)
from fsdp2lab.config import TrainConfig
from fsdp2lab.data import tokens
from fsdp2lab.runtime import faults, logs
from fsdp2lab.runtime.distributed import on_rank0

log = logs.get_logger(__name__)


def run_info(cfg: TrainConfig, model: nn.Module, source: str | None) -> dict:
    """What a save reads of the run (``save_hf``'s ``run``): the Hugging Face config of its
    ``model``, the model folder ``source`` it started from, the companion files' hashes as the run
    reads them (a file changed later is not copied), and its flags (a LoRA run's: its adapters'
    config)."""
    return {
        "hf_config": ckpt_state.hf_config_of(model),
        "hf_source": source,
        "companions": ckpt_state.companion_files(source, cfg.tokenizer),
        "config": dataclasses.asdict(cfg),
    }


def check_target(cfg: TrainConfig, model: nn.Module, source: str | None) -> None:
    """A UsageError when ``--save-hf`` may not write its folder: the model, tokenizer, token or
    checkpoint folder the run reads, a folder fsdp2lab did not write, a file, an unwritable
    parent, or too little free space for ``model``'s parameters (in the dtype the save writes,
    each rank's shards and then the joined files). Leftovers of dead saves beside it are tidied
    first."""
    mine = {}
    if cfg.ckpt_dir:
        mine[Path(cfg.ckpt_dir).resolve()] = "the checkpoint folder (--ckpt-dir)"
    if tokens.is_tokens(cfg.dataset):
        token_dir = Path(cfg.dataset.removeprefix(tokens.PREFIX)).resolve()
        mine[token_dir] = "the token folder the run reads"
    adapters_only = cfg.lora_rank is not None and not cfg.merge
    saved = [p for p in model.parameters() if p.requires_grad or not adapters_only]
    run = run_info(cfg, model, source)
    written_as = save_dtype(cfg.save_dtype, None if adapters_only else run["hf_config"])
    entries = [Entry(str(i), str(i), tuple(p.shape), p.dtype) for i, p in enumerate(saved)]
    nbytes = sum(e.nbytes for e in saved_as(entries, written_as))
    prepare_out(Path(cfg.save_hf), run, mine, nbytes, "--save-hf")


def _entries(state: dict[str, torch.Tensor], group) -> list[Entry]:
    """Every rank's tensors (global shapes), in model order: a pipeline stage holds some."""
    mine = [(name, tuple(t.shape), t.dtype) for name, t in state.items()]
    parts: list = [mine]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, mine, group=group)
    seen: dict[str, Entry] = {}
    for part in parts:
        for name, shape, dtype in part:
            seen.setdefault(name, Entry(name, name, shape, dtype))
    return list(seen.values())


def save_hf(
    model: nn.Module,
    out: str | os.PathLike,
    run: dict,
    group=None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    asynchronous: bool = False,
    step: int = 0,
    dtype: str | None = None,
) -> list[Path] | Future:
    """Write ``model`` (parallelised, on every rank: a collective over ``group``) as a
    ``from_pretrained`` folder ``out``. ``run``: the run's ``hf_config``, ``hf_source`` and
    ``companions`` (``checkpoint.state.run_info``); a LoRA run's also its ``config`` (the flags).
    Returns the files written (rank 0's list; the others': empty). ``asynchronous``: through
    ``dcp.async_save``: the shards are copied to memory, then written, joined and renamed into
    place by background threads; returns a Future of the files. ``step``: for the fault drills
    (:func:`fsdp2lab.runtime.faults.hf_writer`). ``dtype``: ``--save-dtype`` (fp32, bf16, fp16;
    None: :func:`~fsdp2lab.checkpoint.safetensors_export.save_dtype`'s default)."""
    out = Path(out)
    state = get_model_state_dict(model, options=StateDictOptions())  # each rank's shards
    flags = run.get("config") or {}
    adapter = flags.get("lora_rank") is not None and not flags.get("merge")
    if flags.get("lora_rank") is not None and flags.get("merge"):
        if flags.get("quantize_base"):
            state = with_source_weights(state, run["hf_source"])
        state = merged_state(model, state)
    if adapter:  # the adapters alone, under PEFT's names
        config, names = _peft_names(run)
        state = {names[k]: v for k, v in state.items() if k in names}
    entries = _entries(state, group)
    entries = saved_as(entries, save_dtype(dtype, None if adapter else run.get("hf_config")))
    tied: dict[str, str] = {}
    if not adapter:
        config, tied = _hf_model_info(run["hf_config"], entries)
    kept = [e for e in entries if e.name not in tied]
    shards = plan_shards(kept, max_shard_size)
    fqn_to_index = {e.name: i for i, shard in enumerate(shards, 1) for e in shard}
    # Each rank serialises its part of one piece at a time.
    index_of = {e.name: i for i, part in enumerate(pieces(kept), 1) for e in part}
    # Each rank's shards in the dtype written (a copy only where it differs).
    dtypes = {e.name: e.out_dtype for e in kept}
    own = {name: t.to(dtypes[name]) for name, t in state.items() if name in fqn_to_index}

    def begin() -> Path | str:
        targets.tidy(out.absolute().parent)
        check_out_folder(out, run, {})
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            return targets.new_folder(out)
        except OSError as e:
            return f"{e.strerror or e}: {e.filename or out}"

    tmp = on_rank0(begin)
    if isinstance(tmp, str):
        raise OSError(tmp)
    rank = dist.get_rank() if dist.is_initialized() else 0
    rank0 = rank == 0
    writer = faults.hf_writer(str(tmp / SHARDS), index_of, rank, step)
    if asynchronous:
        try:
            written = dcp.async_save(own, storage_writer=writer, process_group=group)
        except BaseException:
            if rank0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        finish = (lambda: _finish(tmp, out, fqn_to_index, config, run, adapter)) if rank0 else None
        return _then(written, finish, tmp)
    try:
        dcp.save(own, storage_writer=writer, process_group=group)
        done = on_rank0(lambda: _finish(tmp, out, fqn_to_index, config, run, adapter))
    finally:
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)  # gone once renamed into place
    if isinstance(done, str):
        raise OSError(done)
    return done if rank0 else []


def _then(written: Future, finish, tmp: Path) -> Future:
    """A Future of the files: once every rank's shards are written, rank 0 (``finish``: not None)
    finishes the folder ``tmp`` in a thread of its own while training goes on."""
    result: Future = Future()

    def complete() -> None:
        try:
            written.result()
            done = finish() if finish else []
            if isinstance(done, str):
                raise OSError(done)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            result.set_exception(e)
        else:
            result.set_result(done)
        finally:
            if finish:
                shutil.rmtree(tmp, ignore_errors=True)  # gone once renamed into place

    threading.Thread(target=complete, name="fsdp2lab-save-hf", daemon=True).start()
    return result


def with_source_weights(state: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """``state`` with each NF4 weight (a QLoRA run's base) replaced by the source folder's, laid
    out alike (each rank reads its own slice, in the weight's dtype): ``--merge`` adds the
    adapters to the weights the model was loaded from, not to their NF4 rounding."""
    from torch.distributed.tensor import DTensor

    from fsdp2lab.models.hf_weights import WeightIndex, base_key
    from fsdp2lab.runtime.torch_compat import local_shape_and_offset, local_tensor, torchao_nf4

    nf4, _ = torchao_nf4()  # a QLoRA run has torchao (checked before launch)
    out, targets = dict(state), {}
    for name, t in state.items():
        local = local_tensor(t) if isinstance(t, DTensor) else t
        if not isinstance(local, nf4):
            continue
        if isinstance(t, DTensor):
            shape, _ = local_shape_and_offset(t)
            empty = torch.empty(shape, dtype=t.dtype, device=local.device)
            fresh = DTensor.from_local(
                empty, t.device_mesh, t.placements, shape=t.shape, stride=_contiguous(t.shape)
            )
        else:
            fresh = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        targets[base_key(name)] = out[name] = fresh
    WeightIndex.read(Path(source)).read_slices(targets)
    return out


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    return torch.empty(shape, device="meta").stride()


def merged_state(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A LoRA model's state (each rank's shards) with the adapters merged in, under the base
    model's names: each adapted linear's weight becomes ``W + scale * B @ A`` as PEFT's
    ``LoraLayer.merge`` computes it (the delta in the adapters' fp32, the sum in ``W``'s dtype).

    Where ``W`` and ``B`` are sharded alike on their output rows (FSDP2 and HSDP: ``Shard(0)``
    or ``Replicate`` on one mesh), each rank merges its own rows: ``W``'s shard plus its rows of
    ``B`` times the whole ``A`` (rank x in_features, gathered). Otherwise the three are gathered
    whole, one weight at a time, merged and sharded again as ``W`` was. Each rank holds its
    merged shards beside the model's until the save ends."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from fsdp2lab.models.lora import ADAPTER, base_key, lora_layers

    scales = {layer.scaling[ADAPTER] for _, layer in lora_layers(model)}
    if len(scales) != 1:
        raise ValueError(f"--merge: the LoRA layers' scales differ ({sorted(scales)})")
    (scale,) = scales
    a_suffix, b_suffix = f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight"
    state = dict(state)
    for name in [n for n in state if n.endswith(a_suffix)]:
        prefix = name.removesuffix(a_suffix)
        a, b = state.pop(name), state.pop(prefix + b_suffix)
        w_name = f"{prefix}.base_layer.weight"
        w = state[w_name]
        if not isinstance(w, DTensor):
            full_a, full_b = (t.full_tensor() if isinstance(t, DTensor) else t for t in (a, b))
            state[w_name] = _merge(w, full_b, full_a, scale)
            continue
        full_a = a.full_tensor() if isinstance(a, DTensor) else a
        rows = isinstance(b, DTensor) and b.device_mesh == w.device_mesh
        rows = rows and b.placements == w.placements
        if rows and all(p == Shard(0) or isinstance(p, Replicate) for p in w.placements):
            local = _merge(w.to_local(), b.to_local(), full_a, scale)
            state[w_name] = DTensor.from_local(
                local, w.device_mesh, w.placements, shape=w.shape, stride=w.stride()
            )
        else:
            full_b = b.full_tensor() if isinstance(b, DTensor) else b
            whole = _merge(w.full_tensor(), full_b, full_a, scale)
            state[w_name] = distribute_tensor(whole, w.device_mesh, w.placements)
    return {base_key(name): t for name, t in state.items()}


def _merge(w: torch.Tensor, b: torch.Tensor, a: torch.Tensor, scale: float) -> torch.Tensor:
    return (w + (b @ a) * scale).to(w.dtype)


def _finish(
    tmp: Path, out: Path, fqn_to_index: dict, config, run: dict, adapter: bool
) -> list[Path] | str:
    """Rank 0, once every rank has written its shards: join them into whole tensors, the
    single-file name, ``config.json``, the companion files, then the rename into place. The
    files, or why it failed."""
    try:
        join_shards(tmp / SHARDS, tmp, fqn_to_index)
        if adapter:
            return _complete_adapter(tmp, out, config)
        return _complete(tmp, out, config, run)
    except OSError as e:
        return f"{e.strerror or e}: {e.filename or out}"
    except Exception as e:  # torch's joining: every rank must hear of it, not rank 0 alone
        return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _complete(tmp: Path, out: Path, config, run: dict) -> list[Path]:
    shutil.rmtree(tmp / SHARDS)
    single_file(sorted(tmp.glob("model-*-of-*.safetensors")) + [tmp / INDEX_FILE])
    layout._write_atomic(tmp / CONFIG_FILE, config.to_json_string())

    def changed(file: Path) -> None:
        log.warning(
            f"fsdp2lab: warning: --save-hf: {file} changed since the run read it (its sha256 "
            f"differs): not copied to {out}"
        )

    for source, name in companion_sources(run, changed):
        shutil.copyfile(source, tmp / name)
    return _in_place(tmp, out)


def _in_place(tmp: Path, out: Path) -> list[Path]:
    """Put the finished folder ``tmp`` in place as ``out``; its files (not the mark)."""
    names = sorted(p.name for p in tmp.iterdir() if p.name != targets.MARK)
    targets.put_in_place(tmp, out)
    return [out / name for name in names]


def _peft_names(run: dict) -> tuple[object, dict[str, str]]:
    """A LoRA run's PEFT adapter config (as ``PeftModel.save_pretrained`` writes it) and each
    adapter's name in PEFT's file, by its name in the training model."""
    from peft.utils import get_peft_model_state_dict

    from fsdp2lab.checkpoint.lora_export import peft_model
    from fsdp2lab.models.lora import is_adapter

    _, model = peft_model(run)
    in_peft = {id(p): n for n, p in model.named_parameters()}
    mine = {
        n: in_peft[id(p)] for n, p in model.get_base_model().named_parameters() if is_adapter(n)
    }
    marks = {peft: torch.empty(0) for peft in mine.values()}  # tell PEFT's renaming apart
    renamed = get_peft_model_state_dict(model, state_dict=marks, save_embedding_layers=False)
    file_name = {id(mark): name for name, mark in renamed.items()}
    config = copy.deepcopy(model.peft_config["default"])
    config.inference_mode = True
    return config, {n: file_name[id(marks[peft])] for n, peft in mine.items()}


def _complete_adapter(tmp: Path, out: Path, config) -> list[Path]:
    shutil.rmtree(tmp / SHARDS)
    (tmp / INDEX_FILE).unlink()
    os.replace(tmp / "model-00001-of-00001.safetensors", tmp / ADAPTER_FILES[1])
    config.save_pretrained(str(tmp))
    return _in_place(tmp, out)
