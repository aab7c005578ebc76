"""The training loop: mesh -> model (meta, parallelised, materialised) -> data -> steps -> evaluation.

Read top to bottom: ``Trainer.__init__`` builds everything, ``fit`` runs epochs of ``train_step``
and ``evaluate``, ``summary`` measures. Checkpointing, preemption and observers (progress bar,
TensorBoard, memory snapshot) attach through ``hooks``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from fsdp2lab.config import TrainConfig
from fsdp2lab.data import loader as data_loader
from fsdp2lab.data.sampler import DistributedBatchSampler
from fsdp2lab.parallel.grad_norm import clip_divisor
from fsdp2lab.parallel.pp import Pipeline
from fsdp2lab.parallel.precision import DTYPES
from fsdp2lab.parallel.strategies import build_model
from fsdp2lab.plan import RunPlan, check_dataset, resolve_here
from fsdp2lab.runtime import logs
from fsdp2lab.runtime.distributed import Runtime, on_rank0
from fsdp2lab.runtime.mesh import build_mesh, dp_rank
from fsdp2lab.training import evaluation
from fsdp2lab.training import metrics as m
from fsdp2lab.training.hooks import Hooks, StopTraining, TrainState
from fsdp2lab.training.loss import model_loss
from fsdp2lab.training.optim import build_optimizer, build_scheduler, clips_in_step
from fsdp2lab.training.optim import step as optimizer_step
from fsdp2lab.training.profiler import DATA_RANGE
from fsdp2lab.training.step_records import StepRecords

log = logs.get_logger(__name__)


class Trainer:
    def __init__(self, plan: RunPlan | TrainConfig, runtime: Runtime, hooks: Sequence[Hooks] = ()):
        if isinstance(plan, TrainConfig):
            plan = resolve_here(plan, runtime.world_size)
        self.plan = plan
        cfg = plan.cfg
        self.runtime = runtime
        self.device = runtime.device
        self.memory = m.MemoryMeter(self.device)  # RSS growth counts from here
        self.hooks = list(hooks)

        # Mesh: named data-parallel (and, where asked, tp/pp) dimensions.
        self.mesh = build_mesh(self.plan.dims, self.device.type)
        self.dp_rank = dp_rank(self.plan.dims, self.mesh)

        # Data: rank 0 resolves/downloads, everyone loads.
        self.data_choice = on_rank0(lambda: data_loader.choose(cfg, self.plan.spec))
        self.train_set, self.test_set = data_loader.load(self.data_choice, cfg, self.plan.spec)
        check_dataset(plan, self.train_set)  # your dataset: does the model take its batches?
        self.sampler = DistributedBatchSampler(
            len(self.train_set),
            self.plan.global_batch,
            cfg.grad_accum_steps,
            self.plan.dims.dp,
            self.dp_rank,
            cfg.seed,
            **data_loader.sampler_order(self.train_set),
        )
        self.loader = data_loader.train_loader(self.train_set, self.sampler, cfg, self.device)
        self.total_steps = self._total_steps()

        # Model: meta (the plan's, copied) -> parallelise -> to_empty -> deterministic init.
        self.model = build_model(plan, self.mesh, self.device)
        # With --pp, self.model is this rank's stage, and the pipeline runs forward and backward.
        self.pipeline = (
            Pipeline(self.model, self.mesh, self.device, plan.n_microbatches, cfg.pp_schedule)
            if self.plan.dims.pp > 1
            else None
        )

        # Train mode, set once (a walk of every module): evaluation sets it back after its eval().
        self.model.train()
        self.optimizer = build_optimizer(self.model.parameters(), cfg)
        self.scheduler, self.scheduler_unit = build_scheduler(self.optimizer, cfg, self.total_steps)
        self.scaler = (
            torch.amp.GradScaler(self.device.type) if cfg.mixed_precision == "fp16" else None
        )
        self.state = TrainState()
        self.metrics = m.MetricsWriter(cfg.metrics_file, runtime.is_main)
        self.records = StepRecords(self.device, runtime.world_size)  # written when values land
        # What observers read (TensorBoard, the progress bar): the last step and epoch records
        # as written to the metrics file.
        self.last_step_record: dict = {}
        self.last_epoch_record: dict = {}
        tokens = cfg.seq_len if self.plan.spec.task == "lm" else None
        self.throughput = m.Throughput(tokens, self.device)
        # Dropout differs per rank (as it would on separate GPUs) but is reproducible.
        torch.manual_seed(cfg.seed * 1000 + runtime.rank)
        self.epoch_times: list[float] = []
        self.last_eval: dict = {}
        self.train_time_s = 0.0
        self.last_grad_norm: torch.Tensor | None = None  # read on logged steps only
        self.step_loss_verdict: torch.Tensor | None = None  # set by train_step: see there
        self.stop_reason: str | None = None  # set by request_stop: end after this step
        self.fit_started = time.perf_counter()

    @property
    def cfg(self) -> TrainConfig:
        return self.plan.cfg

    # ------------------------------------------------------------------ setup helpers
    def _total_steps(self) -> int:
        steps = self.sampler.steps_per_epoch * self.cfg.epochs
        return min(steps, self.cfg.max_steps) if self.cfg.max_steps is not None else steps

    def describe(self) -> str:
        mesh = " x ".join(
            f"{n}={s}" for n, s in zip(self.mesh.mesh_dim_names, self.mesh.shape, strict=True)
        )
        params = f"{self.plan.params_total:,} parameters"
        if self.cfg.lora_rank is not None:
            trainable = sum(p.numel() for p in self.plan.meta_model.parameters() if p.requires_grad)
            params += f", {trainable:,} of them LoRA rank {self.cfg.lora_rank} adapters"
        return (
            f"fsdp2lab: {self.cfg.strategy} on {self.runtime.world_size} rank(s) [{self.device.type}/"
            f"{self.runtime.backend}], mesh {mesh}, model {self.cfg.model} ({params}), "
            f"global batch {self.plan.global_batch} = {self.plan.micro_batch}/rank x {self.plan.dims.dp} dp x "
            f"{self.cfg.grad_accum_steps} accum\n"
            f"fsdp2lab: dataset: {self.data_choice.note}; {len(self.train_set)} train / {len(self.test_set)} test samples"
        )

    def _autocast(self):
        if self.plan.strategy.autocast and self.cfg.mixed_precision != "fp32":
            return torch.autocast(self.device.type, dtype=DTYPES[self.cfg.mixed_precision])
        return contextlib.nullcontext()

    def _loss(
        self,
        output: torch.Tensor,
        target: torch.Tensor,
        reduction: str = "mean",
        weight: float = 1.0,
        root: bool = False,
    ) -> torch.Tensor:
        """The plan's loss (yours), else cross-entropy over chunks of tokens (``loss.py``), times
        ``weight``; ``root``: backward starts at it, with a gradient of 1."""
        return model_loss(output, target, self.plan.loss, reduction, weight, root)

    def _to_device(self, batch):
        x, y = batch
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def _next_batch(self, batches):
        with torch.profiler.record_function(DATA_RANGE):
            return self._to_device(next(batches))

    def _all_reduce_sum(self, values: list[float] | torch.Tensor) -> list[float]:
        """Sums over the ranks, read on the host (a device sync)."""
        if not isinstance(values, torch.Tensor):
            values = torch.tensor(values, dtype=torch.float64, device=self.device)
        if dist.is_initialized() and self.runtime.world_size > 1:
            dist.all_reduce(values)
        return values.tolist()

    @property
    def replicas_per_dp_rank(self) -> int:
        """How many ranks see the same data-parallel share (tensor/pipeline parallel copies)."""
        return self.runtime.world_size // self.plan.dims.dp

    # ------------------------------------------------------------------ training
    def train_step(self, batches) -> tuple[torch.Tensor, int | torch.Tensor]:
        """One optimizer step over K micro-batches; returns (this rank's mean loss, its samples):
        0 when a hook dropped the update, a 0-dim tensor on the device where the device decides."""
        self.optimizer.zero_grad(set_to_none=True)
        k = self.cfg.grad_accum_steps
        share = 1.0 / k  # a micro-batch's share of the step's mean loss
        loss_sum = None
        samples = 0
        for micro in range(k):
            x, y = self._next_batch(batches)
            if self.pipeline is not None:
                # The schedule runs forward and backward over pipeline micro-batches.
                loss = self.pipeline.train_step(
                    x,
                    y,
                    lambda out, target: self._loss(out, target, weight=share),
                    finalize=micro == k - 1,
                )
            else:
                with self.plan.strategy.sync_context(self.model, micro == k - 1), self._autocast():
                    root = self.scaler is None  # a scaler backpropagates from its scaled loss
                    loss = self._loss(self.model(x), y, weight=share, root=root)
                    if self.scaler is not None:
                        self.scaler.scale(loss).backward()
                    else:
                        loss.backward()
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
            samples += len(x)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        log_step = self.logs_step(self.state.step + 1)
        self.step_loss_verdict = None  # whether the loss was finite on every rank, as the norm says
        max_norm = self.cfg.max_grad_norm
        # A fused step divides the gradients by the clip factor as it reads them: no pass of its own.
        clip_in_step = max_norm is not None and clips_in_step(self.optimizer, self.scaler)
        if max_norm is not None or log_step:
            # The loss rides on the norm's all-reduce (where it has one over every rank), so the
            # NaN guard needs no collective of its own; not under fp16, whose scaler owns infs.
            flag = loss_sum if self.scaler is None else None
            self.last_grad_norm, self.step_loss_verdict = self.plan.strategy.clip_grad_norm(
                self.model, None if clip_in_step else max_norm, flag
            )
        drops = [hook.before_optimizer_step(self, loss_sum) for hook in self.hooks]
        if any(drop is True for drop in drops):
            self.optimizer.zero_grad(set_to_none=True)  # the update is dropped
            if self.scaler is not None:  # its inf check ran: it backs off as after an overflow
                self.scaler.update()
            return loss_sum, 0
        on_device = [drop for drop in drops if isinstance(drop, torch.Tensor)]
        dropped = torch.stack(on_device).amax() if on_device else None  # 1.0: dropped there
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            divisor = clip_divisor(self.last_grad_norm, max_norm) if clip_in_step else None
            optimizer_step(self.optimizer, dropped, divisor)
        if self.scheduler_unit == "step":
            self.scheduler.step()
        return loss_sum, samples if dropped is None else samples * (1 - dropped)

    def fit(self) -> dict:
        cfg = self.cfg
        log.info(self.describe())
        for hook in self.hooks:
            hook.before_fit(self)
        start = self.fit_started = time.perf_counter()
        try:
            while self.state.epoch <= cfg.epochs and not self.done():
                self._train_epoch()
        except StopTraining as stop:
            self.records.flush()  # the steps done have their records
            log.info(f"fsdp2lab: training stopped: {stop}")
            self.train_time_s += time.perf_counter() - start
            return {}
        self.train_time_s += time.perf_counter() - start
        if self.stop_reason:
            log.info(f"fsdp2lab: training stopped: {self.stop_reason}")
        summary = self.summary()
        self.metrics.write("summary", **summary)
        for hook in self.hooks:
            hook.after_fit(self)
        return summary

    def request_stop(self, reason: str) -> None:
        """End training normally (summary, checkpoint, saved model) after the current step."""
        self.stop_reason = reason

    def elapsed_s(self) -> float:
        """Training wall time so far, evaluations included (runs before a resume too)."""
        return self.train_time_s + time.perf_counter() - self.fit_started

    def epoch_complete(self) -> bool:
        """No full global batch is left in this epoch."""
        return self.state.epoch_samples + self.plan.global_batch > len(self.train_set)

    def training_complete(self) -> bool:
        """The run's last step is done: --max-steps reached, or every epoch trained."""
        st, max_steps = self.state, self.cfg.max_steps
        return (max_steps is not None and st.step >= max_steps) or st.epoch > self.cfg.epochs

    def logs_step(self, step: int) -> bool:
        """Whether step ``step`` writes a step event: every --log-every-steps, and --max-steps."""
        return step % self.cfg.log_every_steps == 0 or step == self.cfg.max_steps

    def done(self) -> bool:
        """Training ends after this step: its last step is done, or a stop was asked for."""
        max_steps = self.cfg.max_steps
        return self.stop_reason is not None or (
            max_steps is not None and self.state.step >= max_steps
        )

    def _train_epoch(self) -> None:
        st = self.state
        self.sampler.set_epoch(st.epoch, st.epoch_samples)
        batches = iter(self.loader)
        for hook in self.hooks:
            hook.epoch_started(self)
        steps_left = self.sampler.steps_per_epoch - st.epoch_samples // self.plan.global_batch
        t0 = time.perf_counter()
        self.throughput.mark(st.samples_seen)
        # This rank's summed loss and samples over the steps whose update ran (on the device);
        # the samples the host counted join them at the epoch's end (no copy to the device a step).
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        host_samples = 0
        for _ in range(steps_left):
            if self.done():
                break
            loss, samples = self.train_step(batches)
            if isinstance(samples, torch.Tensor):  # the device decided whether the update ran
                kept = samples.to(self.device, torch.float64)
                step_totals = torch.stack([loss.double() * kept, kept])
                totals += torch.where(kept > 0, step_totals, 0.0)  # a dropped step's NaN stays out
            elif samples:  # 0: a hook dropped the update
                totals[0] += loss.double() * samples
                host_samples += samples
            st.step += 1
            st.samples_seen += self.plan.global_batch
            st.epoch_samples += self.plan.global_batch
            if self.logs_step(st.step):
                self._log_step(loss)
            for hook in self.hooks:  # the NaN guard first: a bad step raises before its record
                hook.after_step(self)
            self.records.poll()
        self.settle()
        epoch_time = time.perf_counter() - t0
        totals[1] += host_samples
        total_loss, total_count = self._all_reduce_sum(totals)
        train_loss = total_loss / max(total_count, 1)
        log.info(f"Train Epoch: {st.epoch} \tLoss: {train_loss:.6f}")
        # Evaluated at this very step already: a periodic evaluation that reached --target-accuracy.
        ev = self.last_eval if self.last_eval.get("step") == st.step else self.run_eval(True)
        epoch_samples = total_count / self.replicas_per_dp_rank
        samples_per_s = epoch_samples / epoch_time if epoch_time > 0 else 0.0
        log.info(f"Epoch {st.epoch} time: {epoch_time:.2f}s ({samples_per_s:,.0f} samples/s)\n")
        self.epoch_times.append(epoch_time)
        self.last_epoch_record = self.metrics.write(
            "epoch",
            epoch=st.epoch,
            step=st.step,
            train_loss=train_loss,
            test_loss=ev["test_loss"],
            test_accuracy=ev["test_accuracy"],
            epoch_time_s=epoch_time,
            samples_per_s=samples_per_s,
        )
        if self.epoch_complete():
            if self.scheduler_unit == "epoch":  # not after an epoch cut short by --max-steps
                self.scheduler.step()
            st.epoch += 1
            st.epoch_samples = 0
        for hook in self.hooks:
            hook.after_epoch(self)

    def settle(self) -> None:
        """Bring the host up to date with the device: pending step records and what hooks left
        on the device (the NaN guard's verdicts). Waits for the device."""
        self.records.flush()
        for hook in self.hooks:
            hook.settle(self)

    def _log_step(self, loss: torch.Tensor) -> None:
        """The step record: mean loss, grad norm, lr, throughput since the last one, and every
        rank's memory (gathered with the losses, in one collective), written when the device's
        values reach the host (``step_records``)."""
        head = {"step": self.state.step, "epoch": self.state.epoch}
        tail = {
            "lr": self.optimizer.param_groups[0]["lr"],
            **({"loss_scale": self.scaler.get_scale()} if self.scaler is not None else {}),
            "samples_seen": self.state.samples_seen,
        }
        rates = self.throughput.since_mark(self.state.samples_seen)
        on_device = {"loss": loss}
        if self.last_grad_norm is not None:
            on_device["grad_norm"] = self.last_grad_norm

        def write(columns: dict[str, list]) -> None:
            mean_loss = sum(columns.pop("loss")) / self.runtime.world_size
            grad_norm = columns.pop("grad_norm", [None])[0]  # the same on every rank
            self.last_step_record = self.metrics.write(
                "step", **head, loss=mean_loss, grad_norm=grad_norm, **tail, **rates(), **columns
            )
            for hook in self.hooks:
                hook.after_step_record(self, self.last_step_record)

        self.records.submit(on_device, self.memory.measure(self.model, self.optimizer), write)

    # ------------------------------------------------------------------ evaluation
    def run_eval(self, epoch_end: bool = False) -> dict:
        """Evaluate on the test set: log, record, and call ``after_eval`` (``evaluation.run``),
        after the pending step records (an evaluation waits for the device anyway)."""
        self.records.flush()
        return evaluation.run(self, epoch_end)

    # ------------------------------------------------------------------ measurement
    def summary(self) -> dict:
        return m.summarize(self)
