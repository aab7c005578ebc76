"""Every torch call that differs across the supported torch versions (2.8 to 2.15), in one place.

Each function detects the feature it needs (a guarded import, ``hasattr``, ``inspect.signature``),
never the version string. Where a feature is missing it takes the public path and says so in one
line, printed once per process, on rank 0. Private torch APIs are used only here, each guarded.

It imports nothing from the rest of fsdp2lab: ``parallel``, ``models`` and ``training`` import it.

What each feature needs (the floor, ``torch>=2.8``, is the highest of the "needs" column):

========================================  =======  ==============================================
feature                                   needs    why
========================================  =======  ==============================================
FSDP2 on CPU (fully_shard over gloo)      2.7      CPU ``Stream.record_event`` (pytorch#145935);
                                                   2.6 fails in ``foreach_all_gather``
fully_shard(reshard_after_forward=None)   2.8      2.7 takes only bool/int (default True)
FSDP2 gradients on gloo correct           2.8      FSDP2 asks for ReduceOp.AVG (fp32/bf16); gloo's
                                                   reduce-scatter AVG returns the SUM up to 2.8
                                                   (pytorch#162338) and all-reduce refuses AVG up
                                                   to 2.7: ``set_force_sum_reduction_for_comms``
                                                   (2.8) makes it SUM + divide
                                                   (``parallel.fsdp2.reduce_with_sum``)
parallelize_module/distribute_tensor      2.7      ``src_data_rank``
torch.distributed.fsdp public FSDP2       2.6      (earlier torch.distributed._composable.fsdp)
pipelining step(finalize_gradients=)      2.15     before: ``pipeline_step`` shadows the stage
                                                   method that finishes the gradients
pipelining on gloo                        !=2.9    2.9's first step sends int64 into float32
                                                   (``fix_stage_handshake``)
schedule ``scale_grads``                  2.7      2.6 sums the micro-batches' gradients
get_total_norm / clip_grads_with_norm_    2.6
P2POp(group_peer=)                        2.6
DCP get/set_state_dict, flatten_optim...  <=2.6    ``async_save(process_group=)`` too (later:
                                                   async_checkpointer_type 2.7, async_stager 2.9)
DeviceMesh slicing, ``_flatten``          <=2.6    private: ``flatten_mesh``
FSDPModule._set_unshard_async_op          <=2.6    private: ``set_unshard_async_op``
FSDPModule.set_custom_reduce_scatter      >2.8     ``set_custom_reduce_scatter`` (else gloo's
                                                   own: an all-reduce of the whole input)
torch.distributed.set_timeout             2.14     before: distributed_c10d._set_pg_timeout
                                                   (private, the same; ``set_group_timeout``)
a gloo group's timeout, read             -        private ``options._timeout`` of its
                                                   backend (``group_timeout_s``; else None)
listing the process groups                -        private ``distributed_c10d._world.pg_map``
                                                   (``process_groups``)
CUDA memory snapshot                      <=2.6    private ``torch.cuda.memory._record_memory_history``
                                                   / ``_dump_snapshot`` (``cuda_memory_history``)
Adam/AdamW fused=True on CPU              <=2.6    (on FSDP2's DTensor shards: tested from 2.8)
a DTensor's part: shape and offset        <=2.6    private ``compute_local_shape_and_global_offset``
                                                   (``local_shape_and_offset``)
a DTensor's local tensor itself           <=2.6    private ``_local_tensor`` (``local_tensor``):
                                                   ``to_local()`` is differentiable, and from
                                                   2.15 gives a parameter a fresh view
DCP HuggingFaceStorageReader, by slices   2.9      2.8's reads every whole file on every rank:
                                                   safetensors' ``get_slice`` instead
                                                   (``hf_storage_reader``)
DCP HuggingFaceStorageWriter, each rank  -        ``save_distributed`` (``hf_shard_writer``)
its shards; consolidated by a mapping              and private ``_consolidate_hf_safetensors.
                                                   consolidate_safetensors_files(fqn_to_index_
                                                   mapping=)`` (``hf_consolidate``); without
                                                   them ``--save-hf`` is refused and ``ckpt
                                                   export`` writes whole files, one at a time
                                                   (also for tensors that are not floating point)
torchdata StatefulDataLoader              0.8      its first release; 0.11 (tested) needs torch>=2
DCP .metadata read without running code  -        ``FileSystemReader.read_metadata`` is a plain
                                                   ``pickle.load`` (2.8: no ``rank``, no private
                                                   ``_get_metadata_path``): ``SafeFileSystemReader``
DCP non-tensor values with weights_only   -        ``DefaultLoadPlanner.load_bytes`` passes
                                                   ``weights_only`` off; private ``_traverse.
                                                   set_element`` (``SafeLoadPlanner``)
TCPStore(master_listen_fd=)               -        the server binds every interface whatever its
                                                   host; handed a socket bound to 127.0.0.1 it
                                                   listens there only (``loopback_store``)
DTensor's shape inference, flagged      -        private ``ShardingPropagator._propagate_
                                                   tensor_meta_non_cached`` runs ops on fake
                                                   global shapes under the dispatch modes
                                                   (``dtensor_shape_inference``: FLOPs skip them)
the memory tracker's module peaks, fast   -        private ``MemTracker._update_peak_stats``,
                                                   ``memory_tracking``, ``_mod_tracker.parents``
                                                   (``ActiveModulePeaks``; else torch's update)
torchao's NF4Tensor, to_nf4 (--quantize-   torchao  ``torchao.quantization`` (0.18; before:
base)                                     0.18     ``torchao.dtypes.nf4tensor``), with FSDP2's
                                                   ``fsdp_pre/post_all_gather`` (``torchao_nf4``)
========================================  =======  ==============================================
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import inspect
import io
import logging
import os
import pathlib
import pickle
import socket
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.fsdp import FSDPModule

from fsdp2lab.runtime import logs

log = logs.get_logger(__name__)


_noticed: set[str] = set()


def notice(key: str, message: str) -> None:
    """Print ``fsdp2lab: MESSAGE`` once per process and ``key``, on rank 0 only."""
    if key in _noticed:
        return
    _noticed.add(key)
    rank0 = dist.get_rank() == 0 if dist.is_initialized() else os.environ.get("RANK", "0") == "0"
    if rank0:
        log.info(f"fsdp2lab: {message}")


def _takes(fn: Callable, name: str) -> bool:
    """Whether ``fn`` has a parameter called ``name`` (a ``**kwargs`` catch-all does not count)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


# -------------------------------------------------------------- FSDP2 private methods
def set_unshard_async_op(module: FSDPModule, enabled: bool) -> bool:
    """Issue FSDP2's pre-forward/pre-backward all-gathers asynchronously (a private method)."""
    if not hasattr(module, "_set_unshard_async_op"):
        notice(
            "unshard-async-op",
            "this torch's FSDP2 has no FSDPModule._set_unshard_async_op: prefetching all-gathers "
            "run synchronously (the same results, less overlap on CPU)",
        )
        return False
    module._set_unshard_async_op(enabled)
    return True


def set_custom_reduce_scatter(module: FSDPModule, reduce_scatter: Callable) -> bool:
    """FSDP2 reduces ``module``'s gradients by ``reduce_scatter(output, input, group, op)``
    (``FSDPModule.set_custom_reduce_scatter``; torch 2.8 has none); False, with one notice,
    where this torch has no such hook (its own reduce-scatter runs)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    except ImportError:
        ReduceScatter = None
    if ReduceScatter is None or not hasattr(module, "set_custom_reduce_scatter"):
        notice(
            "custom-reduce-scatter",
            "this torch's FSDP2 has no set_custom_reduce_scatter: gradients are reduced by the "
            "process group's reduce-scatter (on gloo an all-reduce: twice the bytes)",
        )
        return False

    class _Call(ReduceScatter):
        def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False) -> None:
            reduce_scatter(output_tensor, input_tensor, group, op)

    module.set_custom_reduce_scatter(_Call())
    return True


# ---------------------------------------------------------------------------- DTensor
def local_tensor(dtensor: Any) -> torch.Tensor:
    """The tensor a DTensor holds on this rank: the same object at every call, no autograd."""
    return dtensor._local_tensor


def local_shape_and_offset(dtensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape of this rank's part of a DTensor and where it starts in the full tensor
    (uneven shards, several mesh dimensions): private ``compute_local_shape_and_global_offset``
    (the function DCP plans its reads with)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        dtensor.shape, dtensor.device_mesh, dtensor.placements
    )
    return tuple(shape), tuple(offset)


def clear_dtensor_caches() -> list[str]:
    """Forget DTensor's sharding-propagation and redistribution caches (this thread's): their
    entries keep the DeviceMesh they were made with, and with it process groups, so that a later
    mesh of the same shape, over new process groups, would run collectives on destroyed ones
    (``fsdp2lab plan`` simulates its rank roles one after another in one process). Returns the
    caches cleared: their places differ between torch versions."""
    from torch.distributed.tensor import DTensor, _redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    caches = {
        "propagate_op_sharding": getattr(propagator.propagate_op_sharding, "cache", None),
        "propagate_tensor_meta": getattr(propagator, "_propagate_tensor_meta_cached", None),
        "gen_transform_infos": getattr(_redistribute, "_gen_transform_infos", None),
    }
    cleared = []
    for name, cache in caches.items():
        if hasattr(cache, "cache_clear"):
            cache.cache_clear()
            cleared.append(name)
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if native is not None:  # the C++ dispatch fast path's own cache (newer torch)
        native()
        cleared.append("native_sharding_propagator")
    return cleared


# ---------------------------------------------------------------------- memory tracker
class ActiveModulePeaks:
    """A mixin for torch's ``MemTracker`` (``FSDPMemTracker``): its update, after every op, of
    the peaks of the modules running now (private ``_update_peak_stats``, which visits every
    module tracked so far and updates those in ``_mod_tracker.parents``) shown only those
    modules. The same statistics, at a cost that no longer grows with the model's depth. Where
    the tracker lacks those private attributes, its own update runs as it is."""

    _by_fqn_key: tuple | None = None

    def _update_peak_stats(self, peak_state: Any) -> None:
        tracking = getattr(self, "memory_tracking", None)
        data = getattr(tracking, "data", None)
        parents = getattr(getattr(self, "_mod_tracker", None), "parents", None)
        if not isinstance(data, dict) or not isinstance(parents, set):
            return super()._update_peak_stats(peak_state)  # type: ignore[misc]
        key = (id(data), len(data))  # modules are added, or die, or all are reset
        if self._by_fqn_key != key:
            by_fqn: dict[str, list] = {}
            for stats in tracking.values():
                by_fqn.setdefault(stats.mod_fqn, []).append(stats)
            self._by_fqn, self._by_fqn_key = by_fqn, key
        running = [stats for fqn in parents for stats in self._by_fqn.get(fqn, ())]
        self.memory_tracking = _Values(running)
        try:
            super()._update_peak_stats(peak_state)  # type: ignore[misc]
        finally:
            self.memory_tracking = tracking

    def reset_mod_stats(self) -> None:
        self._by_fqn_key = None
        super().reset_mod_stats()  # type: ignore[misc]


class _Values:
    """What ``_update_peak_stats`` reads of ``memory_tracking``: its values."""

    def __init__(self, values: list) -> None:
        self._values = values

    def values(self) -> list:
        return self._values


# -------------------------------------------------------------------------- DCP readers
_inferring = [0, 0]  # [shape inferences running now, contexts entered]


def _infer_shape_flagged(original: Callable) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        _inferring[0] += 1
        try:
            return original(*args, **kwargs)
        finally:
            _inferring[0] -= 1

    return run


def pipeline_checks_local_shards() -> bool:
    """Whether torch's pipelining checks a stage's DTensor output by its local shard (torch with
    ``_DTensorMeta`` in ``pipelining._utils``) rather than by its global shape (torch 2.8)."""
    from torch.distributed.pipelining import _utils

    return hasattr(_utils, "_DTensorMeta")


@contextlib.contextmanager
def dtensor_shape_inference() -> Iterator[Callable[[], bool]]:
    """For the duration, a function saying whether DTensor's sharding propagation is running an
    op now to infer its output's global shape (on fake tensors of the global shapes; the dispatch
    modes below see it as if it computed). Private ``ShardingPropagator.
    _propagate_tensor_meta_non_cached``, shadowed to flag its calls; where torch has none, the
    function never says so and a notice says FLOPs may count those inferences. Reentrant."""
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    name = "_propagate_tensor_meta_non_cached"
    original = getattr(propagator, name, None)
    if original is None:
        notice(name, "DTensor's shape inference is not detected in this torch: FLOPs "
                     "counted under --tp may include it")  # fmt: skip
        yield lambda: False
        return
    outer = _inferring[1] > 0
    _inferring[1] += 1
    try:
        with (
            contextlib.nullcontext()
            if outer
            else _shadowed(propagator, **{name: _infer_shape_flagged(original)})
        ):
            yield lambda: _inferring[0] > 0
    finally:
        _inferring[1] -= 1


def hf_storage_reader() -> type | None:
    """DCP's ``HuggingFaceStorageReader`` where it reads each rank's slices of a safetensors file
    (``get_slice`` per read request: ``_process_read_request``, 2.9+); None where it is missing
    or reads whole files on every rank (2.8): then the caller reads the slices itself."""
    try:
        from torch.distributed.checkpoint import HuggingFaceStorageReader
    except ImportError:
        return None
    if not hasattr(HuggingFaceStorageReader, "_process_read_request"):
        notice(
            "hf_storage_reader",
            "fsdp2lab: this torch's HuggingFaceStorageReader reads whole files on every rank: "
            "the weights are read with safetensors' get_slice instead",
        )
        return None
    return HuggingFaceStorageReader


def _hf_writer_class() -> type | None:
    try:
        from torch.distributed.checkpoint import HuggingFaceStorageWriter
    except ImportError:
        return None
    return (
        HuggingFaceStorageWriter
        if _takes(HuggingFaceStorageWriter.__init__, "save_distributed")
        else None
    )


def _hf_consolidate() -> Callable | None:
    try:
        from torch.distributed.checkpoint._consolidate_hf_safetensors import (
            consolidate_safetensors_files,
        )
    except ImportError:
        return None
    return (
        consolidate_safetensors_files
        if _takes(consolidate_safetensors_files, "fqn_to_index_mapping")
        else None
    )


def hf_sharded_save_missing() -> str | None:
    """None where :func:`hf_shard_writer` and :func:`hf_consolidate` work; else what is missing."""
    if _hf_writer_class() is None:
        return "this torch's HuggingFaceStorageWriter has no save_distributed"
    if _hf_consolidate() is None:
        return "this torch cannot consolidate safetensors shards by a tensor-to-file mapping"
    return None


def hf_consolidation_missing(dtypes) -> str | None:
    """None where :func:`hf_consolidate` joins tensors of these ``dtypes``; else why not (it
    sizes elements with ``torch.finfo``: floating point only)."""
    missing = hf_sharded_save_missing()
    if missing is None:
        others = sorted({str(d).removeprefix("torch.") for d in dtypes if not d.is_floating_point})
        if others:
            missing = f"torch's safetensors consolidation takes floating point only, not {', '.join(others)}"
    return missing


def hf_shard_writer(path: str, fqn_to_index: dict[str, int]) -> Any:
    """DCP's ``HuggingFaceStorageWriter`` writing, on every rank, its own part of each tensor to
    ``path`` (one file per index of ``fqn_to_index``, tensor name -> 1..N)."""
    writer = _hf_writer_class()
    if writer is None:
        raise RuntimeError(hf_sharded_save_missing())
    return writer(path, fqn_to_index_mapping=fqn_to_index, save_distributed=True)


def hf_consolidate(shards: str, out: str, fqn_to_index: dict[str, int]) -> None:
    """Join the shards :func:`hf_shard_writer` wrote in ``shards`` into whole tensors, one at a
    time, in ``out``: ``model-0000K-of-0000N.safetensors`` (tensor name -> K in
    ``fqn_to_index``) and their index. torch's private ``_consolidate_hf_safetensors``."""
    consolidate = _hf_consolidate()
    if consolidate is None:
        raise RuntimeError(hf_sharded_save_missing())
    consolidate(input_dir=shards, output_dir=out, fqn_to_index_mapping=fqn_to_index)


class RefusedPickle(pickle.UnpicklingError):
    """A checkpoint file names something other than plain data: it is not loaded."""


def _dcp_metadata_class(module: str, name: str) -> Any:
    """What a DCP ``.metadata`` pickle may name: DCP's metadata classes, ``torch.Size``, dtypes
    and layouts, paths and builtin containers; None for anything else."""
    from torch.distributed.checkpoint import filesystem, metadata

    if module == metadata.__name__:
        found = getattr(metadata, name, None)
        return found if isinstance(found, type) and found.__module__ == module else None
    allowed: dict[tuple[str, str], Any] = {
        (filesystem.__name__, "_StorageInfo"): filesystem._StorageInfo,
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
        ("collections", "OrderedDict"): collections.OrderedDict,
    }
    if (module, name) in allowed:
        return allowed[module, name]
    if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
        return getattr(torch, name)
    if module.split(".")[0] == "pathlib" and name in ("PosixPath", "PurePosixPath", "Path"):
        return getattr(pathlib, name)
    if module == "builtins" and name in ("set", "frozenset", "tuple", "list", "dict", "slice"):
        return getattr(builtins, name)
    return None


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _dcp_metadata_class(module, name)
        if found is None:
            raise RefusedPickle(f"it names {module}.{name}")
        return found


def load_dcp_metadata(stream: io.BufferedIOBase) -> Any:
    """Unpickle a DCP ``.metadata`` stream admitting only DCP's metadata classes (no code runs);
    a RefusedPickle names the first thing refused."""
    return _MetadataUnpickler(stream).load()


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` whose ``read_metadata`` runs no code: a restricted unpickler
    instead of ``pickle.load``; anything but a ``Metadata`` is a RefusedPickle."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        rank = kwargs.get("rank")
        if hasattr(self, "_get_metadata_path"):  # 2.9+: also per-rank ``__R.metadata``
            path = self._get_metadata_path(rank)
        else:
            path = self.fs.concat_path(self.path, ".metadata")
        with self.fs.create_stream(path, "rb") as stream:
            metadata = load_dcp_metadata(stream)
        if not isinstance(metadata, Metadata):
            raise RefusedPickle(f"it holds a {type(metadata).__name__}")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor values load with ``torch.load(weights_only=
    True)``: plain data only (an object that would run code is an ``UnpicklingError``)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        loaded = torch.load(value, weights_only=True)
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


# --------------------------------------------------------------------------- torchao NF4
QLORA_INSTALL = "pip install -e '.[qlora]'"


class _EnumConstantNotice(logging.Filter):
    """Drops torch's warning that an Enum registered as a pytree constant needs no
    registration: torchao registers several at import, and transformers imports torchao wherever
    it is installed, so every process of a ``hf:`` or LoRA run would print them on stderr."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "is an Enum subclass and is now natively supported" not in record.getMessage()


logging.getLogger("torch.utils._pytree").addFilter(_EnumConstantNotice())


def torchao_nf4() -> tuple[type, Callable] | str:
    """torchao's ``(NF4Tensor, to_nf4)`` (``torchao.quantization``; before 0.18
    ``torchao.dtypes.nf4tensor``), or why there is none: torchao missing, or one without them or
    without FSDP2's all-gather hooks on NF4Tensor."""
    try:
        from torchao.quantization import NF4Tensor, to_nf4
    except ImportError:
        try:
            from torchao.dtypes.nf4tensor import NF4Tensor, to_nf4
        except ImportError:
            try:
                import torchao
            except ImportError:
                return f"--quantize-base needs torchao, which is not installed ({QLORA_INSTALL})"
            version = getattr(torchao, "__version__", "?")
            return f"--quantize-base: torchao {version} has no NF4Tensor ({QLORA_INSTALL})"
    if not all(hasattr(NF4Tensor, h) for h in ("fsdp_pre_all_gather", "fsdp_post_all_gather")):
        return f"--quantize-base: this torchao's NF4Tensor has no FSDP2 all-gather hooks ({QLORA_INSTALL})"
    return NF4Tensor, to_nf4


# ---------------------------------------------------------------------- process groups
def process_groups() -> list:
    """Every process group this process has created (private ``distributed_c10d._world``); only
    the default one, with a notice, where that is missing."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is None or not hasattr(world, "pg_map"):
        notice(
            "process-groups",
            "this torch does not list its process groups (distributed_c10d._world): only the "
            "default group's timeout is changed",
        )
        return [dist.group.WORLD] if dist.is_initialized() else []
    return list(world.pg_map)


def set_group_timeout(group: Any, timeout: timedelta) -> bool:
    """``dist.set_timeout(timeout, group)`` (torch 2.14); before, the private
    ``distributed_c10d._set_pg_timeout``, which does the same; else a notice, and it is unchanged."""
    if hasattr(dist, "set_timeout"):
        dist.set_timeout(timeout, group)
        return True
    legacy = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if legacy is not None:
        legacy(timeout, group)
        return True
    notice(
        "set-timeout",
        "this torch cannot change a process group's timeout (torch.distributed.set_timeout): "
        "collectives keep the start-up timeout",
    )
    return False


def group_timeout_s(group: Any) -> float | None:
    """The seconds ``group``'s collectives wait on the CPU (gloo) backend: its private
    ``options._timeout``; None where this torch does not expose it."""
    try:
        timeout = group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return None
    return timeout.total_seconds() if isinstance(timeout, timedelta) else None


# ------------------------------------------------------------------ CUDA memory history
def cuda_memory_history() -> tuple[Callable, Callable] | None:
    """(``_record_memory_history``, ``_dump_snapshot``) of ``torch.cuda.memory`` (private, the
    documented way to take a memory snapshot); None where this torch lacks them."""
    memory = torch.cuda.memory
    record = getattr(memory, "_record_memory_history", None)
    dump = getattr(memory, "_dump_snapshot", None)
    return (record, dump) if record is not None and dump is not None else None


# -------------------------------------------------------------------------- DeviceMesh
def flatten_mesh(mesh: Any) -> Any:
    """The 1D mesh that flattens ``mesh``'s dimensions (``DeviceMesh._flatten``, private); None,
    with a notice, where there is none.

    DTensor then reduces over those dimensions in one collective; without it, one per dimension:
    the same values.
    """
    if not hasattr(mesh, "_flatten"):
        notice(
            "mesh-flatten",
            "this torch's DeviceMesh has no _flatten: DTensor reduces over several mesh "
            "dimensions one dimension at a time",
        )
        return None
    return mesh._flatten()


# ------------------------------------------------------------------------- pipelining
def fix_stage_handshake(stage: Any) -> Any:
    """Make the first step's handshake between neighbouring stages match in dtype (gloo checks).

    torch 2.9's ``PipelineStage._get_init_p2p_neighbors_ops`` (private) sends an int64 and receives
    into a float32 tensor, which gloo refuses ("Received data size doesn't match expected size");
    2.10 sends float32. Where its tensors differ, the sends are made float32 (the values are not
    used); elsewhere (2.8 has no handshake, 2.10 is right) the stage is left as is.
    """
    init_ops = getattr(stage, "_get_init_p2p_neighbors_ops", None)
    if init_ops is None or len({op.tensor.dtype for op in init_ops()}) <= 1:
        return stage

    def float32_ops() -> list:
        ops = init_ops()
        for op in ops:
            op.tensor = op.tensor.float()
        return ops

    stage._get_init_p2p_neighbors_ops = float32_ops
    return stage


def stage_shapes_given(received: Any, sent: Any, is_first: bool, is_last: bool) -> dict[str, tuple]:
    """``PipelineStage`` keyword arguments that give a stage the shapes it receives and sends,
    so its first step exchanges none with its neighbours: the activations (every torch), and
    where the stage takes them (torch >= 2.9), the gradients coming back."""
    from torch.distributed.pipelining import PipelineStage

    given = {"input_args": (received,), "output_args": (sent,)}
    if _takes(PipelineStage.__init__, "output_grads"):
        given["output_grads"] = (None if is_last else sent,)
        given["input_grads"] = (None if is_first else received,)
    return given


@contextlib.contextmanager
def _shadowed(obj: Any, **methods: Callable) -> Iterator[None]:
    """Shadow methods of ``obj`` with instance attributes for the duration, then remove them."""
    for name, fn in methods.items():
        setattr(obj, name, fn)
    try:
        yield
    finally:
        for name in methods:
            delattr(obj, name)


def pipeline_step(schedule: Any, stage: Any, *args: Any, finalize: bool, **kwargs: Any) -> Any:
    """``schedule.step(*args, **kwargs)``; with ``finalize=False`` (a gradient-accumulation step
    before the last one) FSDP's gradient reduction and the schedule's division of the gradients by
    the micro-batch count are left for the finalizing step.

    ``step(finalize_gradients=)`` does that from torch 2.15. Before, every step finishes the
    gradients, which the non-final steps here avoid by shadowing the stage's public method that
    does it: 2.10-2.14 ``PipelineStage.perform_reduce_grad`` (FSDP reduction and division); 2.8-2.9
    the last micro-batch's ``backward_one_chunk(last_backward=True)`` (FSDP reduction) and
    ``scale_grads`` (division). FSDP keeps the unsharded gradients (and parameters) until the
    finalizing step, as 2.15 does.
    """
    if _takes(schedule.step, "finalize_gradients"):
        return schedule.step(*args, finalize_gradients=finalize, **kwargs)
    if finalize or not isinstance(stage.submod, FSDPModule):
        return schedule.step(*args, **kwargs)
    if hasattr(stage, "perform_reduce_grad"):
        with _shadowed(stage, perform_reduce_grad=lambda grad_scale_factor: None):
            return schedule.step(*args, **kwargs)
    if _takes(stage.backward_one_chunk, "last_backward") and hasattr(stage, "scale_grads"):
        backward_one_chunk = stage.backward_one_chunk

        def not_last(*a: Any, **kw: Any) -> Any:
            return backward_one_chunk(*a, **{**kw, "last_backward": False})

        with _shadowed(stage, backward_one_chunk=not_last, scale_grads=lambda *a, **kw: None):
            return schedule.step(*args, **kwargs)
    raise RuntimeError(
        "this torch's pipeline schedules cannot leave FSDP's gradient reduction for a later step "
        "(no finalize_gradients, perform_reduce_grad or backward_one_chunk(last_backward)): "
        "use --grad-accum-steps 1 with --pp"
    )


def no_step_outputs(schedule: Any) -> dict[str, bool]:
    """``step()``'s keywords that make a training step's last stage keep no micro-batch's output
    (its logits) past that micro-batch's backward: ``return_outputs=False`` where the schedule
    takes it (its default merges them all into one batch output at the step's end)."""
    return {"return_outputs": False} if _takes(schedule.step, "return_outputs") else {}


# -------------------------------------------------------------- rendezvous store
def loopback_store(
    port: int, world_size: int, is_master: bool, timeout: timedelta, listen_fd: int | None = None
) -> Any:
    """A c10d ``TCPStore`` at 127.0.0.1:``port`` whose server listens on loopback only.

    Given any host, the server binds every interface; handed a socket bound to 127.0.0.1
    (``master_listen_fd``) it listens on that one: ``listen_fd``'s, already listening on
    ``port`` (the launcher's), else one bound here. ``port`` 0: an ephemeral port (``.port``).
    """
    if not is_master:
        return dist.TCPStore("127.0.0.1", port, world_size, False, timeout)
    if listen_fd is not None:
        sock = socket.socket(fileno=listen_fd)
    else:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if listen_fd is None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen(socket.SOMAXCONN)
        store = dist.TCPStore(
            "127.0.0.1",
            sock.getsockname()[1],
            world_size,
            True,
            timeout,
            master_listen_fd=sock.fileno(),
        )
    except TypeError:  # a TCPStore without master_listen_fd
        sock.close()
        notice(
            "store-any-interface",
            "this torch's TCPStore takes no bound socket: the rendezvous store listens on "
            "every interface",
        )
        return dist.TCPStore("127.0.0.1", port, world_size, True, timeout)
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns the socket now
    return store
