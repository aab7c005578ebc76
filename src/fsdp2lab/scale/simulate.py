"""Run the real parallelize code and training steps at any world size, in one CPU process, with
no memory: a fake process group (every collective returns at once), FakeTensorMode (tensors have
shapes, dtypes and storages, no data), and torch's FSDP2 memory tracker.

The model is the run plan's meta model, parallelised by the same strategy code as ``train``
(TP, activation checkpointing, ``fully_shard`` per unit over the data-parallel mesh), moved to
(fake) memory, and stepped with the configured optimizer. What is measured:

* memory by category over a steady-state step (:class:`FSDPMemTracker`: sharded and unsharded
  parameters, gradients, optimizer state, activations, temporaries, all-gather and
  reduce-scatter buffers), and the peak of their sum;
* the sharded state this rank holds (``training.metrics.state_bytes``, as ``train`` reports it);
* every collective's bytes by mesh dimension (a dispatch mode over the c10d ops);
* FLOPs (``torch.utils.flop_counter``'s formulas), forward and all;
* after the step, the peak of each later phase of the run (:func:`run_phases`: evaluation, the
  ``--save-model`` gather, a checkpoint save) and the host memory it takes.

Under ``--pp`` each pipeline stage is a rank role of its own (:func:`stage_ranks`): the rank's
stage is cut by the real ``pp.stage_module`` and parallelised as ``train`` does, and its step is
the real :class:`fsdp2lab.parallel.pp.Pipeline` ``train_step`` running torch's GPipe or 1F1B
schedule. The fake process group's point-to-point sends and receives return at once, so one
stage runs its whole schedule alone: micro-batch forwards and backwards in the schedule's order
(under 1F1B, its warmup and three cycles, the cycles left out counted: :func:`cycles_run`), a
received activation (or gradient) being a fresh fake tensor of the stage's input (output)
shape. The schedule's stage is built with those shapes given (:func:`stage_shapes`, the meta
model's stages, tensor-parallelised under ``--tp``, run in turn) instead of inferring them from
its neighbours as a real run does.
The bytes sent and received are counted on the ``pp`` mesh dimension.

With ``--quantize-base nf4`` the strategy's ``parallelize`` makes the base's linear weights NF4
on the meta device before sharding, as ``train``'s does; :func:`load_nf4_shards` then gives each
shard the parts its loading sets. Each step gathers the NF4 parts and dequantizes every weight
for its matmuls: those ops are traced, tracked and counted as any other.

With ``--cpu-offload`` (FSDP2's ``CPUOffloadPolicy``) the step is simulated as without it (on
fake CPU tensors FSDP2's copies between host and device are no ops), and what the policy moves
is taken from it (:func:`offload_figures`): the tracker's device peak leaves out the sharded
parameters, gradients and optimizer state, and the optimizer's step (the host runs it); the
largest unit's shards, copied to the device before its all-gather, are added to the peaks of the
phases that gather (the step and evaluation); the host holds the state; the shards each step
copies in are the bytes its ops (not the optimizer's) read of them (each all-gather's input made
from them, forward's and, where a unit was resharded, backward's), and the gradients it copies
out are the sharded gradients at each reduction.

Tensors are fake CPU tensors: the machine needs no GPU, and the fake process group runs FSDP2's
CPU path (no CUDA streams). Attention through ``scaled_dot_product_attention`` takes the CPU
flash kernel, which saves what the CUDA flash kernel saves (output and log-sum-exp), so its
memory is the GPU kernel's. The tracker then leaves out CUDA's rounding of allocations up to
512 bytes, and the optimizer steps one tensor at a time (:func:`_unfused`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import logging
import warnings
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from fsdp2lab.errors import UsageError
from fsdp2lab.models import nf4
from fsdp2lab.models.hf import masks_decided_as_for_real_tensors
from fsdp2lab.models.materialize import to_empty
from fsdp2lab.models.spec import logits_of
from fsdp2lab.parallel.fsdp2 import (
    default_unit_min_params,
    reduces_every_micro_batch,
    reshard_all,
)
from fsdp2lab.parallel.grad_norm import clip_divisor
from fsdp2lab.plan import RunPlan
from fsdp2lab.runtime.mesh import build_mesh
from fsdp2lab.runtime.torch_compat import (
    ActiveModulePeaks,
    clear_dtensor_caches,
    dtensor_shape_inference,
    local_tensor,
    pipeline_checks_local_shards,
)
from fsdp2lab.scale.op_trace import Op, OpTrace, nbytes, uncompiled, uncompiled_backward
from fsdp2lab.training.loss import model_loss
from fsdp2lab.training.metrics import state_bytes
from fsdp2lab.training.optim import build_optimizer, clips_in_step

# torch's FLOP formulas; the fused LoRA adapter's in-place addmm_ counts as addmm does.
FLOP_FORMULAS = {**flop_registry, torch.ops.aten.addmm_: flop_registry[torch.ops.aten.addmm]}
# FSDPMemTracker's categories, under the names a plan reports.
CATEGORIES = {
    "Sharded Param": "params",
    "Unsharded Param": "unsharded_params",
    "Buffer": "buffers",
    "Sharded Grad": "grads",
    "Unsharded Grad": "unsharded_grads",
    "Activation": "activations",
    "Temp": "temporaries",
    "All Gather": "all_gather",
    "Reduce Scatter": "reduce_scatter",
    "OptState": "optimizer_state",
    "Inputs": "inputs",
}
# The tracker's categories that ``--cpu-offload`` keeps in host memory.
ON_HOST = ("Sharded Param", "Sharded Grad", "OptState")
# ``--cpu-offload``: a unit's shards copied to the device for its all-gather (not tracked).
SHARD_COPIES = "shard_copies"


@dataclass
class Collective:
    """One kind of collective on one mesh dimension: calls and bytes per step."""

    calls: int = 0
    tensor_bytes: int = 0  # the gathered output / the reduced input, summed over calls
    wire_bytes: int = (
        0  # what each rank sends (= receives) in a ring: (n-1)/n of that, 2x for all-reduce
    )


@dataclass
class Phase:
    """One phase of the run on one rank: its tracked device peak, the categories at that peak,
    and the host memory it takes (a copy of tensors on the CPU)."""

    name: str
    peak_bytes: int
    peak_by_category: dict[str, int]
    host_bytes: int = 0
    note: str = ""  # what the phase runs, in a few words


@dataclass
class RoleRun:
    """What one rank measured over a tracked training step, and the run's other phases."""

    rank: int
    peak_bytes: int  # the tracker's peak of all categories together
    peak_by_category: dict[str, int]  # each category at that peak
    state: dict[str, int]  # param_bytes, grad_bytes, optimizer_state_bytes (its shards)
    flops: int  # this rank's FLOPs in one optimizer step (recomputation included)
    forward_flops: int  # of which in forward passes (no recomputation)
    # mesh dimension -> collective -> totals per optimizer step
    comm: dict[str, dict[str, Collective]] = field(default_factory=dict)
    stage: int | None = None  # --pp: this rank's pipeline stage
    modules: tuple[str, ...] = ()  # --pp: the stage's modules
    # Every phase of the run this rank goes through (:func:`run_phases`), the training step first.
    phases: list[Phase] = field(default_factory=list)
    # The step's ops in order (scale.op_trace), keyed by storage addresses: not compared.
    ops: list[Op] = field(default_factory=list, compare=False, repr=False)
    # --cpu-offload (:func:`offload_figures`): host_bytes, h2d_bytes, d2h_bytes, shard_copy_bytes
    offload: dict[str, int] = field(default_factory=dict)

    @property
    def state_bytes(self) -> int:
        return sum(self.state.values())


_COLLECTIVES = {
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "alltoall_base_": "all_to_all",  # FSDP2's reduce-scatter on gloo (fsdp2.all_to_all_reduce_scatter)
    "send": "send",  # pipeline stages: activations forward, their gradients backward
    "recv_": "recv",
}
# Functional collectives (``_c10d_functional``: DTensor's, so tensor parallelism's): the op's
# input, the group's name last.
_FUNCTIONAL = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
}


class SeesShapeInference:
    """A dispatch mode's mixin: while the mode is entered, ``self._inferring()`` says whether
    DTensor is running ops to infer an output's global shape (``dtensor_shape_inference``)."""

    def _inferring(self) -> bool:
        return False

    def __enter__(self):
        self._inference = contextlib.ExitStack()
        self._inferring = self._inference.enter_context(dtensor_shape_inference())
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._inference.close()


class StepCounter(SeesShapeInference, TorchDispatchMode):
    """Counts the FLOPs (``torch.utils.flop_counter``'s formulas) and the c10d collectives, by
    the mesh dimension of their group, dispatched while active.

    FLOPs are this rank's, as its kernels compute them: an op on DTensors is left to DTensor
    (:func:`defer_to_dtensor`), which runs it on the local shards with this mode still active, so
    a tensor-parallel matmul counts its shard of the weight and attention its local heads. The
    ops DTensor runs to infer an output's global shape are not counted. Every op on DTensors is
    left to DTensor, not only those with FLOPs: its collectives (a norm's partial sums reduced by
    ``full_tensor``) then reach this mode, where the fake tensor mode below would drop them.

    A plain dispatch mode: ``FlopCounterMode``'s module hooks, under the memory tracker, make the
    tracker keep backward's temporaries (+1.8 GiB a layer of Llama 3 70B)."""

    def __init__(self, group_dims: dict[str, str]):
        super().__init__()
        self.group_dims = group_dims  # process group name -> mesh dimension name
        self.comm: dict[str, dict[str, Collective]] = defaultdict(lambda: defaultdict(Collective))
        self.flops = 0
        self.trace = OpTrace()  # every op, for the time model

    def get_total_flops(self) -> int:
        return self.flops

    def mark(self) -> tuple:
        """Where the counts are now, for :meth:`repeat`."""
        comm = {(dim, kind): dataclasses.astuple(c) for dim, kinds in self.comm.items()
                for kind, c in kinds.items()}  # fmt: skip
        return len(self.trace.ops), self.flops, comm

    def uncounted(self, make):
        """``make()``, whose ops are left out of the counts (what it makes is still held)."""
        start = len(self.trace.ops)
        made = make()
        del self.trace.ops[start:]
        return made

    def repeat(self, mark: tuple, times: int) -> None:
        """Count what was dispatched since ``mark`` ``times`` more times."""
        start, flops, comm = mark
        self.trace.ops += self.trace.ops[start:] * times
        self.flops += (self.flops - flops) * times
        for dim, kinds in self.comm.items():
            for kind, c in kinds.items():
                before = comm.get((dim, kind), (0, 0, 0))
                c.calls, c.tensor_bytes, c.wire_bytes = (
                    now + (now - was) * times
                    for now, was in zip(dataclasses.astuple(c), before, strict=True)
                )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if defer_to_dtensor(types):
            return NotImplemented  # DTensor runs it on its local shards, counted then
        out = func(*args, **kwargs)
        inferring = self._inferring()
        formula = FLOP_FORMULAS.get(func._overloadpacket)
        flops = formula(*args, **kwargs, out_val=out) if formula and not inferring else 0
        self.flops += flops
        namespace, _, name = func._schema.name.partition("::")
        if namespace == "c10d" and name in _COLLECTIVES:
            kind = _COLLECTIVES[name]
            group = next(a for a in args if isinstance(a, torch.ScriptObject))
            # all-gather: the output; reduce-scatter: the input; all-reduce: the tensor
            big = args[1] if kind == "reduce_scatter" else args[0]
            self._count(kind, dist.ProcessGroup.unbox(group), nbytes(big), args, args)
        elif namespace == "_c10d_functional" and name in _FUNCTIONAL:
            kind = _FUNCTIONAL[name]
            group = dist.distributed_c10d._resolve_process_group(args[-1])
            scale = group.size() if kind == "all_gather" else 1  # the gathered output
            self._count(kind, group, scale * nbytes(args[0]), args[0], out)
        elif not inferring:
            self.trace.record(func, args, kwargs, out, flops)
        return out

    def _count(self, kind: str, group: dist.ProcessGroup, nbytes: int, reads, writes) -> None:
        size = group.size()
        if size == 1:
            return
        dim = self.group_dims.get(group.group_name, "other")
        entry = self.comm[dim][kind]
        entry.calls += 1
        entry.tensor_bytes += nbytes
        if kind in ("send", "recv"):  # point to point: the tensor itself
            wire = nbytes
        else:
            wire = (2 if kind == "all_reduce" else 1) * nbytes * (size - 1) // size
        entry.wire_bytes += wire
        if not self._inferring():
            self.trace.collective(kind, dim, reads, writes, wire)


def defer_to_dtensor(types) -> bool:
    """Whether a dispatch mode should return ``NotImplemented`` for an op whose tensor argument
    ``types`` these are: true where one is a DTensor. The op then goes to DTensor's dispatch with
    the mode still on the stack, and the mode sees the local ops each rank runs (their shapes
    are the shards'), not the op at the DTensor's global shape."""
    return any(issubclass(t, DTensor) for t in types)


class LocalFlopCounter(SeesShapeInference, TorchDispatchMode):
    """Entered just after torch's ``counter`` (a ``FlopCounterMode``), so above it: ops on
    DTensors go to DTensor's dispatch (:func:`defer_to_dtensor`), and the counter counts the
    FLOPs of the local ops this rank runs; the ops DTensor runs to infer an output's global
    shape leave its counts as they were. ``FlopCounterMode`` alone counts a DTensor op at its
    global shape."""

    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if defer_to_dtensor(types):
            return NotImplemented
        if not self._inferring():
            return func(*args, **(kwargs or {}))
        counts = copy.deepcopy(self.counter.flop_counts)
        out = func(*args, **(kwargs or {}))
        self.counter.flop_counts = counts
        return out


def _group_dims(mesh) -> dict[str, str]:
    names = mesh.mesh_dim_names or ()
    return {mesh.get_group(name).group_name: name for name in names}


def check_supported(plan: RunPlan) -> None:
    """What a plan cannot model: a UsageError naming it."""
    cfg = plan.cfg
    if cfg.strategy != "fsdp2":
        raise UsageError(
            f"fsdp2lab plan models --strategy fsdp2 (with HSDP and --tp), not {cfg.strategy}"
        )
    if cfg.mixed_precision == "fp16":
        raise UsageError(
            "fsdp2lab plan does not model --mixed-precision fp16 (its loss scaler); use bf16"
        )


def _batch(plan: RunPlan, size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of ``size`` samples (default: the training micro-batch)."""
    cfg, spec, b = plan.cfg, plan.spec, size or plan.micro_batch
    if spec.task == "lm":
        vocab = cfg.vocab_size
        return (
            torch.randint(0, vocab, (b, cfg.seq_len)),
            torch.randint(0, vocab, (b, cfg.seq_len)),
        )
    classes = spec.num_classes or cfg.num_classes
    return torch.randn(b, *spec.input_shape), torch.randint(0, classes, (b,))


def _loss(plan: RunPlan, output, target, reduction: str = "mean", **share) -> torch.Tensor:
    """The trainer's loss (``training.loss.model_loss``: yours, else chunked cross-entropy; ``share``:
    its ``weight`` and ``root``). ``--compile`` compiles the units only: the loss's ops are traced
    unfusable, unless the loss is a ``torch.compile``'d function of yours."""
    if hasattr(plan.loss, "_torchdynamo_orig_callable"):
        return model_loss(output, target, plan.loss, reduction, **share)
    with uncompiled():
        loss = model_loss(output, target, plan.loss, reduction, **share)
    with contextlib.suppress(TypeError):  # an output of yours without logits: left as traced
        uncompiled_backward(loss, logits_of(output))
    return loss


def train_step(
    plan: RunPlan, model, optimizer, batches, before_forward=None, pipeline=None, counts=()
) -> None:
    """One optimizer step over ``grad_accum_steps`` micro-batches, as the trainer runs it
    (through ``pipeline``, a :class:`fsdp2lab.parallel.pp.Pipeline`, under ``--pp``); with
    ``--max-grad-norm``, the strategy's gradient norm and clipping (its all-reduce, the loss
    riding on it) before the optimizer step. (The trainer also takes the norm, unclipped, on
    the steps it logs.) ``counts``: tallies with ``mark``/``repeat``; with them, the micro-batches
    between the second and the last are counted, not run (:func:`alike_micro_batches`)."""
    optimizer.zero_grad(set_to_none=True)
    k = plan.cfg.grad_accum_steps
    share = 1.0 / k  # a micro-batch's share of the step's mean loss
    loss_sum = None
    for micro in alike_micro_batches(k, counts):
        x, y = batches()
        if pipeline is not None:
            loss = pipeline.train_step(
                x,
                y,
                lambda out, target: _loss(plan, out, target, weight=share),
                finalize=micro == k - 1,
            )
        else:
            if before_forward is not None:
                before_forward()
            with plan.strategy.sync_context(model, micro == k - 1):
                loss = _loss(plan, model(x), y, weight=share, root=True)  # no fp16 in plans
                loss.backward()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    max_norm = plan.cfg.max_grad_norm
    if max_norm is not None:  # as the trainer clips: the factor rides on a fused step
        in_step = clips_in_step(optimizer)  # built fused; simulated unfused (``_unfused``)
        norm, _ = plan.strategy.clip_grad_norm(model, None if in_step else max_norm, loss_sum)
        if in_step:  # the factor's own ops; the fused kernel divides as it reads the gradients
            clip_divisor(norm, max_norm)
    optimizer.step()


def _sim_plan(plan: RunPlan, device_type: str) -> RunPlan:
    """The plan as simulated: the sharding units and collectives that ``device_type`` gets (the
    simulation itself runs on CPU, where ``--cpu-offload`` would move nothing: :func:`offload_figures`)."""
    changes: dict = {"cpu_offload": False, "compile": False}
    if plan.cfg.fsdp_unit_min_params is None:
        changes["fsdp_unit_min_params"] = default_unit_min_params(device_type)
    cfg = dataclasses.replace(plan.cfg, **changes)
    return dataclasses.replace(plan, device_type=device_type, cfg=cfg)


def create_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's state, as its first step creates it, from zero gradients (no forward or
    backward): the tracked step is then a steady one."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr


def track(plan: RunPlan, model, optimizer, batches, counters=(), pipeline=None, tracker=None):
    """A steady optimizer step (the optimizer state made first) under the memory tracker and
    ``counters`` (context managers of tallies with ``mark``/``repeat``, which count the
    micro-batches :func:`alike_micro_batches` leaves out); returns (peak bytes, peak by
    category). The tracker is entered before the first forward: FSDP2 resizes its gathered
    parameters' storages in place, and one made before the tracker saw it would count as a
    temporary never freed.
    ``pipeline``: the step runs through it (``--pp``). ``tracker``: an ``FSDPMemTracker`` of
    ``model`` and ``optimizer`` to use (to track later phases with it), else a new one."""
    create_optimizer_state(optimizer)
    tracker = tracker or memory_tracker(model, optimizer)
    x, _ = batches()
    tracker.track_inputs((x,))
    with tracker, contextlib.ExitStack() as stack:
        tallies = [stack.enter_context(counter) for counter in counters]
        # The tracker's per-module statistics hold one forward each; its peak is kept. A
        # pipeline's forwards follow each other before their backwards: the statistics are reset
        # before each micro-batch's forward, by a hook put first once the tracker (which
        # re-registers FSDP's own hooks first on entry) is in.
        if pipeline is not None:
            handle = model.register_forward_pre_hook(
                lambda module, args: tracker.reset_mod_stats(), prepend=True
            )
            stack.callback(handle.remove)
        train_step(plan, model, optimizer, batches, tracker.reset_mod_stats, pipeline, tallies)
    return _peak(tracker)


def memory_tracker(model, optimizer, offload: bool = False):
    """torch's ``FSDPMemTracker`` of ``model`` and ``optimizer``, blind to DTensor's shape
    inference: under the plan's fake tensor mode it runs ops at their global shapes in that mode
    (where a real run uses a fake mode of its own, which no tracker sees), e.g. a whole
    vocabulary's log-softmax for the vocabulary-parallel loss. With ``offload``
    (``--cpu-offload``) it also keeps ``device_peak``: the peak of what stays on the device (the
    categories but :data:`ON_HOST`, outside the optimizer's step) since it was entered.
    Parameters FSDP2 leaves alone (``RunPlan.unsharded``: not DTensors) count as a rank's
    parameters, as FSDP2's own shards do."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType

    whole = [p for p in model.parameters() if not isinstance(p, DTensor)]

    class Tracker(SeesShapeInference, ActiveModulePeaks, FSDPMemTracker):
        device_peak: tuple[int, dict[str, int]] | None = None

        def _register_module_and_optimizer_hooks(self) -> None:
            super()._register_module_and_optimizer_hooks()
            for param in whole:
                self._update_and_maybe_create_winfos(param, _FSDPRefType.SHARDED_PARAM)

        def __enter__(self):
            entered = super().__enter__()
            if offload:
                self.device_peak = _by_category(self._curr_mem_snap, ON_HOST)
            return entered

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self._inferring():
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _update_peak_stats(self, peak_state) -> None:
            super()._update_peak_stats(peak_state)
            if offload and not self._in_opt:
                now = _by_category(self._curr_mem_snap, ON_HOST)
                if now[0] > self.device_peak[0]:
                    self.device_peak = now

    return Tracker(model, optimizer)


def _peak(tracker) -> tuple[int, dict[str, int]]:
    """The tracker's peak since it was last entered: (bytes, bytes by category at it); under
    ``--cpu-offload``, the device's (:func:`memory_tracker`)."""
    if tracker.device_peak is not None:
        return tracker.device_peak
    return _by_category(tracker.get_tracker_snapshot("peak"))


def _by_category(snapshot: dict, leave_out: tuple[str, ...] = ()) -> tuple[int, dict[str, int]]:
    """A tracker snapshot's (first device's) total and its bytes by category, without the
    tracker's categories ``leave_out``."""
    device = next(iter(snapshot.values())) if snapshot else {}
    named = {str(getattr(k, "value", k)): int(v) for k, v in device.items()}
    total = named.pop("Total", 0) - sum(named.pop(name, 0) for name in leave_out)
    return total, {CATEGORIES.get(name, name): v for name, v in named.items()}


def eval_batch(plan: RunPlan) -> int:
    """Samples in one evaluation forward on a rank: ``--test-batch-size``, or this rank's share
    of the test set where that is smaller and known (synthetic data: a quarter of
    ``--synthetic-size``, as ``data.loader`` makes it; ``data.sampler.eval_shards`` splits it)."""
    batch = plan.cfg.test_batch_size
    dataset = plan.spec.default_dataset if plan.cfg.dataset == "auto" else plan.cfg.dataset
    if dataset == "synthetic":
        n_test = max(1, plan.cfg.synthetic_size // 4)
        batch = min(batch, -(-n_test // plan.dims.dp))
    return batch


def run_phases(plan: RunPlan, model, optimizer, tracker) -> list[Phase]:
    """The run's phases after a training step, each tracked from what the step left live (the
    parameters, gradients and optimizer state; FSDP2 frees gradients only at the next step):

    * evaluation (``training/evaluation.py``): a forward of one test batch (:func:`eval_batch`)
      under ``no_grad``, its loss summed by the trainer's loss function, then every unit
      resharded. Not under ``--pp`` (the pipeline's evaluation schedule infers its shapes from
      its neighbours);
    * ``--save-model``: ``checkpoint.export.full_state_dict``'s gather, ``get_model_state_dict``
      with ``full_state_dict`` and ``cpu_offload``: each tensor gathered whole on the device,
      copied to rank 0's host memory and dropped; under ``--pp`` (no ``cpu_offload`` there) the
      stage's full tensors all stay on the device until its stages join them on the host;
    * a checkpoint save (``--ckpt-dir``): ``checkpoint.state.capture``'s ``get_state_dict``;
      ``dcp.save`` adds nothing on the device (it copies one tensor at a time to the host, the
      host bytes given), ``dcp.async_save`` stages the rank's whole state to host memory first
      (``--async-checkpoint``: those bytes)."""
    cfg = plan.cfg
    phases = []
    if plan.dims.pp == 1:
        batch = eval_batch(plan)
        x, y = _batch(plan, batch)
        with tracker:  # entering restarts the tracker's peak at what is live now
            tracker.reset_mod_stats()  # its per-module statistics hold one forward
            tracker.track_inputs((x, y))
            _evaluate(plan, model, x, y)
        del x, y
        note = f"one test batch of {batch}" + (
            f" x {cfg.seq_len} tokens" if plan.spec.task == "lm" else ""
        )
        phases.append(Phase("evaluation", *_peak(tracker), note=note))
    if cfg.save_model:
        with tracker:
            host = _gather_full(model, keep_on_device=plan.dims.pp > 1)
        if plan.dims.pp > 1:  # every stage's parts are joined on each rank of the stage group
            host = nbytes(list(plan.meta_model.state_dict().values()))
        note = "whole tensors, one at a time, to rank 0's host memory"
        if plan.dims.pp > 1:
            note = "the stage's whole tensors on the device, then every stage's on the host"
        phases.append(Phase("--save-model gather", *_peak(tracker), host_bytes=host, note=note))
    if cfg.ckpt_dir:
        with tracker:
            staged, largest = _checkpoint_state(model, optimizer)
        if cfg.async_checkpoint:
            host, note = staged, "dcp.async_save: the rank's state staged to host memory"
        else:
            host, note = largest, "dcp.save: one tensor at a time to host memory"
        phases.append(Phase("checkpoint save", *_peak(tracker), host_bytes=host, note=note))
    return phases


@torch.no_grad()
def _evaluate(plan: RunPlan, model, x: torch.Tensor, y: torch.Tensor) -> None:
    """One test batch as ``training.evaluation.evaluate`` runs it: the forward, the loss summed
    by the trainer's loss. (Its correct count, ``loss.correct``, reads values, which fake tensors
    have not; it holds one chunk's argmax at a time, the loss's chunk of tokens.)"""
    model.eval()
    out = logits_of(model(x))
    _loss(plan, out, y, reduction="sum")
    del out
    reshard_all(model)
    model.train()


def _gather_full(model, keep_on_device: bool) -> int:
    """The device side of ``get_model_state_dict(model, full_state_dict=True, cpu_offload=...)``
    (torch's ``_gather_state_dict``): each DTensor made whole (``full_tensor``: its
    all-gather), then copied to the host and dropped, or, ``keep_on_device``, kept until all are
    gathered. Returns the bytes of the whole tensors (what the host copy holds)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    kept, total = [], 0
    for value in get_model_state_dict(model).values():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
            if keep_on_device:
                kept.append(value)
        del value
    return total


def _checkpoint_state(model, optimizer) -> tuple[int, int]:
    """The model and optimizer state a checkpoint saves (``checkpoint.state.capture``'s
    ``get_state_dict``): (this rank's bytes of it, its largest tensor's bytes). DCP writes, and
    ``async_save`` stages, each tensor's local part: a DTensor's shard."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.utils._pytree import tree_leaves

    from fsdp2lab.checkpoint.state import state_dict_options

    state = get_state_dict(model, optimizer, options=state_dict_options(model))
    sizes = [
        nbytes(t.to_local() if isinstance(t, DTensor) else t)
        for t in tree_leaves(state)
        if isinstance(t, torch.Tensor)
    ]
    return sum(sizes), max(sizes, default=0)


def stage_ranks(plan: RunPlan) -> list[int]:
    """One rank of each distinct role: rank 0 without ``--pp``; with it, the first rank of each
    stage (``pp`` is the outermost mesh dimension, so rank r is at stage r // (world / pp))."""
    per_stage = plan.world_size // plan.dims.pp
    return [s * per_stage for s in range(plan.dims.pp)]


def stage_shapes(
    plan: RunPlan, micro_batch: int, tp_mesh=None, last: int | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each pipeline stage's (input, output) for a micro-batch of ``micro_batch`` samples, as
    meta tensors: the meta model cut into its stages (``pp.make_stage``, as ``pp.stage_module``
    cuts it) and run in turn under fake tensor mode (a forward may read a value, which plain meta
    tensors refuse), in the parameters' compute dtype (mixed precision); with ``tp_mesh``, each
    stage tensor-parallelised as ``train`` does it (what it sends is then this rank's shard).
    ``last``: the stages up to that one only."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fsdp2lab.parallel import pp, tp
    from fsdp2lab.plan import sample_input

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(plan.cfg.mixed_precision)
    stages = [
        pp.make_stage(plan.spec, copy.deepcopy(plan.meta_model), plan.stages, i)
        for i in range(len(plan.stages) if last is None else last + 1)
    ]
    if tp_mesh is not None:
        stages = [tp.apply_tp(stage, plan.spec, tp_mesh) for stage in stages]
    shapes = []
    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
        x = sample_input(plan.spec, plan.cfg, micro_batch)
        for i, stage in enumerate(stages):
            if dtype is not None:
                stage.to(dtype)
                if x.is_floating_point():
                    x = x.to(dtype)
            y = stage(x)
            # The last stage's output is checked, not sent: by its global shape on a torch
            # whose pipelining has no DTensor metadata.
            whole = i == len(plan.stages) - 1 and not pipeline_checks_local_shards()
            y = y.to_local() if isinstance(y, DTensor) and not whole else y
            shapes.append(((x.shape, x.dtype), (y.shape, y.dtype)))
            x = y
    return [
        tuple(torch.empty(shape, dtype=dt, device="meta") for shape, dt in pair) for pair in shapes
    ]


def static_pipeline(plan: RunPlan, model, mesh, device, shapes, counts=()):
    """The trainer's :class:`Pipeline` for this rank's stage, and the samples a training step
    runs through it. Its schedule is made with the stages' shapes given (``shapes``:
    :func:`stage_shapes`), so it sends no metadata; with ``counts`` (tallies with
    ``mark``/``repeat``), for the micro-batches of :func:`cycles_run`, the others counted."""
    from fsdp2lab.parallel.pp import Pipeline

    n = plan.n_microbatches
    pipeline = Pipeline(model, mesh, device, n, plan.cfg.pp_schedule)
    runs = cycles_run(plan, pipeline.stage_index) if counts else n
    rows = plan.micro_batch // n * runs
    received, sent = shapes[pipeline.stage_index]
    stage = pipeline.give_shapes(
        _batch(plan, rows)[0].shape,
        torch.empty_like(received, device=device),
        torch.empty_like(sent, device=device),
        n=runs,
    )
    alike_cycles(stage, runs, n, counts)
    return pipeline, rows


def cycles_run(plan: RunPlan, stage: int) -> int:
    """The micro-batches a simulated step runs through pipeline stage ``stage``, of
    ``--pp-microbatches``. Under 1F1B a stage runs a forward for each stage from it to the last
    (torch's warmup), then cycles of a backward and a forward, then the backwards left: the
    cycles are alike. The warmup and three cycles are run (at least as many micro-batches as
    stages, which the schedule takes), and the last cycle but one is counted again for each
    left out (:func:`alike_cycles`). GPipe's forwards all come before its backwards, each
    micro-batch's activations held: every one is run."""
    n, stages = plan.n_microbatches, plan.dims.pp
    if plan.cfg.pp_schedule != "1f1b":
        return n
    return min(n, max(stages, stages - stage + 3))


def alike_cycles(stage, runs: int, n: int, counts) -> None:
    """Make ``stage`` (a ``PipelineStage`` whose 1F1B schedule runs ``runs`` micro-batches of
    the step's ``n``: :func:`cycles_run`) count its last cycle but one, from that cycle's forward
    to the last's, ``n - runs`` times more with ``counts`` (tallies with ``mark``/``repeat``).
    ``tests/test_simulate_micro_batches.py`` checks it against every micro-batch run."""
    if runs == n:
        return
    forward_one_chunk = stage.forward_one_chunk
    marks = []

    def counted(chunk: int, *args, **kwargs):
        if chunk == runs - 2:
            marks[:] = [c.mark() for c in counts]
        elif chunk == runs - 1:
            for c, mark in zip(counts, marks, strict=True):
                c.repeat(mark, n - runs)
        return forward_one_chunk(chunk, *args, **kwargs)

    stage.forward_one_chunk = counted


def simulate(plan: RunPlan, rank: int = 0, device_type: str = "cuda") -> RoleRun:
    """Rank ``rank`` of ``plan``: its memory, state, FLOPs and collectives over a steady step.

    Makes the optimizer state from zero gradients, then runs one optimizer step under the
    memory tracker, counting its FLOPs and collectives (the loss's chunks and the micro-batches
    that are alike run once and counted for each). ``device_type`` is the device the plan is
    for (its default sharding units); ``"cpu"`` to compare with a run on CPU ranks. Under
    ``--pp``, ``rank``'s stage (:func:`stage_ranks`: one rank per stage).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    check_supported(plan)
    if dist.is_initialized():
        raise RuntimeError("simulate() needs a process without a process group")
    offload = plan.cfg.cpu_offload
    plan = _sim_plan(plan, device_type)
    # Tensors held in reference cycles are freed when the collector runs, which it does by counts
    # of allocations: collected now, it runs at the same points of every simulation, whatever
    # the process ran before (else a peak moves with the process's history). Under
    # :func:`frozen_heap`, this sees only what was made since.
    gc.collect()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.world_size)
    try:
        mesh = build_mesh(plan.dims, "cpu")
        device = torch.device("cpu")
        if plan.dims.pp > 1:
            tp_mesh = mesh["tp"] if plan.dims.tp > 1 else None
            shapes = stage_shapes(
                plan, plan.micro_batch // plan.n_microbatches, tp_mesh, mesh["pp"].get_local_rank()
            )
        # Parallelised on the meta device, as the trainer does; then fake memory for it. (The
        # pipeline's log of its stages and the TP plan's name are the trainer's, not the plan's.)
        with _quiet("fsdp2lab.parallel.pp"), _quiet("fsdp2lab.parallel.strategies"):
            model = plan.strategy.parallelize(copy.deepcopy(plan.meta_model), plan, mesh, device)
        with (
            FakeTensorMode(allow_non_fake_inputs=True),
            masks_decided_as_for_real_tensors(),
            _nf4_checks_fake_pointers(),
        ):
            to_empty(model, device)
            if plan.cfg.quantize_base:
                load_nf4_shards(model, device)
            optimizer = _unfused(build_optimizer(model.parameters(), plan.cfg))

            counter = StepCounter(_group_dims(mesh))
            counter.trace.mark_optimizer(optimizer)
            forward = _ForwardFlops(counter)
            counters = (counter, forward.installed(model))
            pipeline, rows = None, plan.micro_batch  # the samples a micro-batch runs
            if plan.dims.pp > 1:
                pipeline, rows = static_pipeline(
                    plan, model, mesh, device, shapes, (counter, forward)
                )

            def batches():  # a whole micro-batch's samples in memory, ``rows`` of them run
                x, y = _batch(plan)
                return (x, y) if rows == plan.micro_batch else (x[:rows], y[:rows])

            tracker = memory_tracker(model, optimizer, offload)
            with alike_loss_chunks(counter):
                peak, by_category = track(
                    plan, model, optimizer, batches, counters, pipeline, tracker
                )
                state = state_bytes(model, optimizer)
                phases = [
                    Phase("training step", peak, by_category, note="forward, backward, optimizer"),
                    *run_phases(plan, model, optimizer, tracker),
                ]
            offloaded = offload_figures(plan, model, counter.trace, state) if offload else {}
        if offload:
            phases = [with_shard_copies(phase, offloaded) for phase in phases]
            peak, by_category = phases[0].peak_bytes, phases[0].peak_by_category
        stage = pipeline.stage_index if pipeline is not None else None
        return RoleRun(
            rank=rank,
            stage=stage,
            modules=plan.stages[stage] if stage is not None else (),
            peak_bytes=peak,
            peak_by_category=by_category,
            state=state,
            flops=counter.flops,
            forward_flops=forward.total,
            comm={d: dict(kinds) for d, kinds in counter.comm.items()},
            phases=phases,
            ops=counter.trace.ops,
            offload=offloaded,
        )
    finally:
        dist.destroy_process_group()
        clear_dtensor_caches()


def offload_figures(plan: RunPlan, model, trace: OpTrace, state: dict[str, int]) -> dict[str, int]:
    """What ``--cpu-offload`` moves for this rank, from its simulated step (``trace``) and its
    sharded ``state``: the host's bytes (parameters, gradients, optimizer state); the bytes of
    shards copied to the device a step (what the step's ops, not the optimizer's, read of the
    sharded parameters: each all-gather's input is made from them); the gradients copied to the
    host (the sharded gradients, at each reduction: every micro-batch or the last,
    ``--grad-accum-reduce``); and the largest unit's shards, on the device while its all-gather
    input is made (FSDP2 copies a unit's shards in just before)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    shards = {trace.storage(part): nbytes(part) for p in model.parameters() for part in _stored(p)}
    h2d = sum(
        size
        for op in trace.ops
        if not op.optimizer
        for storage, size in zip(op.reads, op.read_bytes, strict=False)
        if storage in shards
    )
    every = reduces_every_micro_batch(plan.cfg.grad_accum_reduce, plan.dims.dp_shard)
    reductions = plan.cfg.grad_accum_steps if every else 1
    unit_of = {}  # parameter -> its unit's FSDP state (modules in pre-order: the innermost unit)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            unit_of.update({id(p): fully_shard.state(module) for p in module.parameters()})
    units: dict[int, int] = defaultdict(int)
    for p in model.parameters():
        units[id(unit_of[id(p)])] += nbytes(_stored(p))
    return {
        "host_bytes": sum(state.values()),
        "h2d_bytes": h2d,
        "d2h_bytes": state["grad_bytes"] * reductions,
        "shard_copy_bytes": max(units.values(), default=0),
    }


def _stored(param) -> list[torch.Tensor]:
    """The tensors that hold this rank's shard of ``param`` (an NF4 shard's parts)."""
    local = local_tensor(param) if isinstance(param, DTensor) else param
    if hasattr(local, "__tensor_flatten__"):
        return [getattr(local, name) for name in local.__tensor_flatten__()[0]]
    return [local]


def with_shard_copies(phase: Phase, offloaded: dict[str, int]) -> Phase:
    """``phase`` with ``--cpu-offload``'s copies of a unit's shards on the device, where the
    phase gathers units (the training step, evaluation)."""
    if phase.name not in ("training step", "evaluation"):
        return phase
    copies = offloaded["shard_copy_bytes"]
    by_category = {**phase.peak_by_category, SHARD_COPIES: copies}
    host = offloaded["host_bytes"] if phase.name == "training step" else phase.host_bytes
    return dataclasses.replace(
        phase, peak_bytes=phase.peak_bytes + copies, peak_by_category=by_category, host_bytes=host
    )


def load_nf4_shards(model, device: torch.device) -> None:
    """Put on ``device`` the parts of each NF4 weight (``--quantize-base``: made NF4 on the meta
    device by the strategy's ``parallelize``, then sharded) that ``to_empty`` leaves on the meta
    device and the run's loading sets (``nf4.quantize_into``: the scales' mean, the NF4
    levels)."""
    for param in model.parameters():
        if nf4.is_nf4(param):
            local = local_tensor(param) if isinstance(param, DTensor) else param
            for name in local.__tensor_flatten__()[0]:
                part = getattr(local, name)
                if part.is_meta:
                    setattr(local, name, torch.empty_like(part, device=device))


def alike_micro_batches(k: int, counts=()) -> Iterator[int]:
    """The micro-batches of a step to run, of ``k``. The first makes the gradients, the last
    reduces them, and those between are alike the second: with ``counts`` (tallies with
    ``mark``/``repeat``), run the first, the second and the last, and count the second once more
    for each between (``tests/test_simulate_micro_batches.py`` checks it against every one run)."""
    if not counts or k <= 3:
        yield from range(k)
        return
    yield 0
    marks = [c.mark() for c in counts]
    yield 1
    for c, mark in zip(counts, marks, strict=True):
        c.repeat(mark, k - 3)
    yield k - 1


@contextlib.contextmanager
def alike_loss_chunks(counter: StepCounter):
    """The loss's chunks (``training.loss._each_chunk``) free what they make but their values,
    and are alike but the last: run the first and the last, and count the first's ops, FLOPs and
    collectives once more for each chunk between (whose values are held, uncounted) (``tests/test_simulate_chunks.py``
    checks it against every chunk run)."""
    from fsdp2lab.training import loss

    every = loss._each_chunk

    def first_and_last(step, chunk: int, *tensors: torch.Tensor) -> torch.Tensor:
        n = -(-tensors[0].shape[0] // chunk)
        if n <= 2:
            return every(step, chunk, *tensors)
        pieces = list(zip(*(t.split(chunk) for t in tensors), strict=True))
        # The values of the chunks between, held as every chunk's are: the first runs beside as
        # many as the last full chunk does.
        zero = functools.partial(torch.zeros, (), device=tensors[0].device)
        between = counter.uncounted(lambda: [zero() for _ in range(n - 2)])
        mark = counter.mark()
        first = step(*pieces[0])
        counter.repeat(mark, n - 2)
        return torch.stack([first, *between, step(*pieces[-1])]).sum()

    loss._each_chunk = first_and_last
    try:
        yield
    finally:
        loss._each_chunk = every


@contextlib.contextmanager
def frozen_heap():
    """For a process that simulates many times: what is alive now is moved out of the
    collector's reach (``gc.freeze``), so that each simulation's collection goes over only what
    was made since (a few ms, where the whole heap of torch and a model library takes a third of
    a second). What is frozen is never collected while frozen, so it frees nothing during a
    simulation either."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def _nf4_checks_fake_pointers():
    """Without torch's warning that a fake tensor's data pointer was read: torchao's NF4
    all-gather compares its output's storages by pointer (equal on fake tensors too)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")
        yield


@contextlib.contextmanager
def _quiet(logger: str):
    """The logger ``logger`` at warnings and up for the duration."""
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(level)


def _unfused(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer stepping one tensor at a time: on fake DTensors the fused Adam(W) kernel is
    tracked as if it copied its whole state (72 against 8 MiB where real tensors measure 8). The
    single-tensor step's temporaries are one parameter's; the fused kernel has none."""
    for group in optimizer.param_groups:
        if group.get("fused"):
            group["fused"], group["foreach"] = False, False
    return optimizer


class _ForwardFlops:
    """The FLOPs counted between the root module's forward start and end (no recomputation)."""

    def __init__(self, counter):
        self.counter = counter
        self.total = 0
        self._start = 0

    @contextlib.contextmanager
    def installed(self, model):
        def pre(module, args):
            self._start = self.counter.get_total_flops()

        def post(module, args, output):
            self.total += self.counter.get_total_flops() - self._start

        handles = [model.register_forward_pre_hook(pre), model.register_forward_hook(post)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def mark(self) -> int:
        return self.total

    def repeat(self, mark: int, times: int) -> None:
        self.total += (self.total - mark) * times
