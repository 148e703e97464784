"""A Lightning callback that sets the largest batch size that trains, like Lightning's own
``BatchSizeFinder``, but seeded by batchfit's prediction.

Lightning's finder starts at 2 and doubles (then bisects): a dozen or more trial fits. This
one predicts the largest batch from the module itself (:func:`batchfit.max_batch_size` on
the module's ``training_step``, with the per-sample input read from the first batch of the
train dataloader, the trainer's optimizer and precision, and the GPU the module is on or a
budget you give), then confirms it with real trial fits: about three when the prediction is
right (see :mod:`batchfit.integrations._trials`).

A trial fit is what Lightning's finder runs: the trainer's own fit loop, with the batch size
attribute set (on the module, its ``hparams`` or the datamodule: ``lightning_setattr``) and
the train dataloader rebuilt, for ``steps_per_trial`` optimizer steps, with the trainer's
callbacks and loggers switched off and validation skipped. Differences, on purpose:

* State is saved in memory, not in a checkpoint file: parameters, buffers, gradients,
  optimizer state and hyper-parameters, the learning-rate schedulers, the precision
  plugin's scaler, the fit loop's progress, and the RNG states (torch, CUDA, numpy,
  ``random``; Lightning's checkpoint does not restore them). Each trial starts from it and
  the fit continues from it, so the fit after the search is bit for bit the fit you would
  have run with that batch size set by hand. Nothing is written to disk.
* Every trial runs at least ``steps_per_trial`` (>= 2) steps, across epoch ends if the
  dataset is short, so the optimizer state the first step creates is part of the peak.
* The batch size set is ``floor(max * (1 - headroom))``: the largest that ran, less a margin
  for what varies between runs (batch shapes, allocator state).

Relies on the same Lightning internals as Lightning's own tuner (the fit loop's state dict
and its dataloader cache); tested with lightning 2.6. Only ``trainer.fit`` is supported, on
one device (no distributed strategies), with dataloaders from the module or a datamodule.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping
from copy import deepcopy
from typing import Any

import torch
from torch import nn

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.loggers.logger import DummyLogger
    from lightning.pytorch.utilities import rank_zero_info
    from lightning.pytorch.utilities.parsing import (
        lightning_getattr,
        lightning_hasattr,
        lightning_setattr,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("batchfit.integrations.lightning needs Lightning: "
                      "pip install 'batchfit[lightning]'") from exc

from batchfit.device.profile import available_memory_bytes
from batchfit.engine.spec import TrainConfig
from batchfit.errors import InvalidInputError
from batchfit.integrations._seed import (
    batch_structure,
    optimizer_options,
    predict,
    prediction_target,
)
from batchfit.integrations._trials import (
    BatchSizeSearch,
    SearchLimits,
    check_positive_int,
    check_steps,
    cpu_memory_cap,
    cpu_trial_room,
    search_in_process,
    trial_line,
)
from batchfit.realrun.state import StateSnapshot

#: Lightning precision flags -> batchfit precision (others trace as fp32).
_PRECISIONS = {"16-mixed": "amp-fp16", "bf16-mixed": "amp-bf16", "16-true": "fp16",
               "bf16-true": "bf16"}


class BatchfitFinder(Callback):
    """Find the largest batch size that trains at the start of ``trainer.fit`` and set it.

    Args:
        batch_arg_name: the attribute holding the batch size, looked up as Lightning does:
            on the module, in ``module.hparams``, on the datamodule and in its ``hparams``
            (every holder is set).
        predicted: skip the prediction and start from this batch size.
        device: the prediction's target: a catalog GPU name, a
            :class:`~batchfit.DeviceProfile` or ``"cpu"``. Default: the GPU the module is
            on; on the CPU there is no prediction unless ``memory_bytes`` is given.
        memory_bytes: the prediction's memory budget (overrides the device's); on the CPU
            also the budget the trial fits run under (default there: the memory the machine
            has available now), so that they can run out of memory at all.
        steps_per_trial: optimizer steps per trial fit (>= 2).
        max_trials: trial fits at most; when they run out, the largest batch that ran is
            used (``search.confirmed`` is then False).
        headroom: the batch size set is the largest that ran, less this fraction.
        approach: the first trial's margin below the prediction, a fraction of it.
        max_batch_size: never try more (the train dataset's length also caps it).
        init_val: the first trial when there is no prediction (then doubled, then bisected).

    Attributes:
        search: the last search (None before the fit starts).

    Raises:
        InvalidInputError: a bad option (at construction); at ``trainer.fit``: no
            ``batch_arg_name`` attribute, dataloaders passed to ``fit`` directly, or a
            distributed strategy.
        DoesNotFitError: even batch size 1 ran out of memory.

    Example:
        >>> import torch, lightning.pytorch as pl
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> class Net(pl.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.batch_size = 4
        ...         self.layer = torch.nn.Linear(8, 1)
        ...     def training_step(self, batch, batch_idx):
        ...         if len(batch[0]) > 24:  # stands in for a step that runs out of memory
        ...             raise torch.OutOfMemoryError("CUDA out of memory")
        ...         return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])
        ...     def train_dataloader(self):
        ...         data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
        ...         return DataLoader(data, batch_size=self.batch_size)
        ...     def configure_optimizers(self):
        ...         return torch.optim.SGD(self.parameters(), lr=0.1)
        >>> finder = BatchfitFinder(predicted=20, headroom=0.0)
        >>> trainer = pl.Trainer(max_steps=3, callbacks=[finder], logger=False,
        ...                      enable_checkpointing=False, enable_progress_bar=False,
        ...                      enable_model_summary=False)
        >>> model = Net()
        >>> trainer.fit(model)
        >>> model.batch_size, finder.search.confirmed
        (24, True)
    """

    def __init__(self, *, batch_arg_name: str = "batch_size", predicted: int | None = None,
                 device: Any = None, memory_bytes: int | None = None,
                 steps_per_trial: int = 2, max_trials: int = 32, headroom: float = 0.05,
                 approach: float = 0.1, max_batch_size: int = 8192, init_val: int = 2):
        if not isinstance(batch_arg_name, str) or not batch_arg_name:
            raise InvalidInputError(f"batch_arg_name must be an attribute name, not {batch_arg_name!r}")
        if predicted is not None:
            check_positive_int(predicted, "predicted")
        if memory_bytes is not None:
            check_positive_int(memory_bytes, "memory_bytes")
        check_steps(steps_per_trial)
        check_positive_int(init_val, "init_val")
        self.limits = SearchLimits(max_batch_size=max_batch_size, max_trials=max_trials,
                                   approach=approach, headroom=headroom)
        self.batch_arg_name = batch_arg_name
        self.predicted, self.device, self.memory_bytes = predicted, device, memory_bytes
        self.steps_per_trial, self.init_val = steps_per_trial, init_val
        self.search: BatchSizeSearch | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
              stage: str | None = None) -> None:
        if stage != "fit":
            return
        if trainer._accelerator_connector.is_distributed:
            raise InvalidInputError(
                "BatchfitFinder does not support distributed strategies (every rank would "
                "have to agree on each trial); find the batch size on one device")
        if not trainer.fit_loop._data_source.is_module():
            raise InvalidInputError(
                "BatchfitFinder cannot change the batch size of dataloaders passed to "
                "trainer.fit(); build them in the module's or a datamodule's "
                f"train_dataloader() from self.{self.batch_arg_name}")
        if not lightning_hasattr(pl_module, self.batch_arg_name):
            raise InvalidInputError(
                f"no {self.batch_arg_name!r} attribute on the module, in module.hparams, on "
                "the datamodule or in its hparams: add it (and build the train dataloader "
                "from it) or pass batch_arg_name=")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.find(trainer, pl_module)

    def find(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> BatchSizeSearch | None:
        """Search now and set the batch size attribute (``on_fit_start`` calls this; call it
        from another hook in a subclass to search later, e.g. after unfreezing a backbone)."""
        if trainer.fast_dev_run:
            warnings.warn("BatchfitFinder skipped: fast_dev_run is on", stacklevel=2)
            return None
        started = time.perf_counter()
        saved = _TrainerState(trainer)
        snapshots = _snapshots(pl_module, trainer.optimizers)
        chosen = lightning_getattr(pl_module, self.batch_arg_name)
        try:
            loader = _train_loader(trainer)
            limits = self.limits.capped_at(getattr(loader, "dataset", None))
            predicted = self.predicted
            if predicted is None:
                predicted = self._predict(trainer, pl_module, loader, limits.max_batch_size)
                _restore(snapshots)  # reading the first batch moved the RNG
            saved.prepare_trials(trainer, self.steps_per_trial)

            def trial(batch_size: int) -> None:
                lightning_setattr(pl_module, self.batch_arg_name, batch_size)
                _forget_dataloaders(trainer)
                saved.rewind(trainer)
                trainer.fit_loop.run()

            def after_trial() -> None:
                saved.rewind(trainer)
                _restore(snapshots)

            search, _ = search_in_process(trial, limits, predicted=predicted,
                                          start=self.init_val, after_trial=after_trial,
                                          started=started, cap=self._cpu_cap(trainer, pl_module),
                                          on_trial=_report_trial)
            chosen = search.recommended_batch_size
        finally:
            saved.restore(trainer)
            lightning_setattr(pl_module, self.batch_arg_name, chosen)
            _forget_dataloaders(trainer)
            _restore(snapshots)  # last: nothing after it may draw random numbers
        self.search = search
        return search

    def _cpu_cap(self, trainer: pl.Trainer, module: pl.LightningModule) -> Any:
        """On the CPU, trials run under the budget (``memory_bytes``, default: the memory the
        machine has available now) less what the model and optimizers hold: in-process
        trials otherwise never run out of memory before the machine does (13 trial fits of
        a small CNN in 2 minutes, and counting). None on a GPU (its memory is the cap)."""
        if module.device.type != "cpu":
            return None
        budget = self.memory_bytes or available_memory_bytes()
        if budget is None:
            return None
        held = _unique_bytes(list(module.parameters()) + list(module.buffers())
                             + [t for o in trainer.optimizers for st in o.state.values()
                                for t in st.values() if isinstance(t, torch.Tensor)])
        room = cpu_trial_room(budget, held)
        return lambda: cpu_memory_cap(room)

    def _predict(self, trainer: pl.Trainer, module: pl.LightningModule, loader: Any,
                 limit: int) -> int | None:
        who = "BatchfitFinder"
        target = prediction_target(module.device, self.device, self.memory_bytes)
        if target is None:
            return None
        structure = batch_structure(next(iter(loader))) if loader is not None else None
        if structure is None or not module.automatic_optimization:
            warnings.warn(f"{who}: no prediction (the train batch is not a tensor, a tuple or "
                          "dict of tensors, or the module optimizes manually); the search "
                          "starts without one", stacklevel=3)
            return None
        spec, rebuild = structure
        return predict(_TrainingStep(module, rebuild), spec, _config(trainer), target, limit, who)


class _TrainingStep(nn.Module):
    """A LightningModule's ``training_step`` as ``forward``, for the prediction's trace: the
    loss the trials backpropagate, not whatever the module's own ``forward`` returns.
    (Tracing deep-copies it; a LightningModule drops its trainer when copied.)"""

    def __init__(self, module: pl.LightningModule, rebuild: Any):
        super().__init__()
        self.module = module
        self.rebuild = rebuild

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.module.training_step(self.rebuild(args, kwargs), 0)
        return out["loss"] if isinstance(out, Mapping) else out


def _report_trial(trial: Any) -> None:
    """One line per trial fit, through Lightning's console logger (rank zero)."""
    rank_zero_info(f"BatchfitFinder: {trial_line(trial)}")


def _unique_bytes(tensors: list[Any]) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors}.values())


def _config(trainer: pl.Trainer) -> TrainConfig:
    optimizer = (optimizer_options(trainer.optimizers[0]) if trainer.optimizers
                 else {"optimizer": "sgd"})
    return TrainConfig(precision=_PRECISIONS.get(str(trainer.precision), "fp32"), **optimizer)


def _train_loader(trainer: pl.Trainer) -> Any:
    """The module's (or datamodule's) train dataloader, if it is a single loader."""
    from torch.utils.data import DataLoader

    loader = trainer.fit_loop._data_source.dataloader()
    return loader if isinstance(loader, DataLoader) else None


def _snapshots(module: nn.Module, optimizers: list[Any]) -> list[StateSnapshot]:
    first = optimizers[0] if optimizers else None
    return [StateSnapshot.take(module, first),
            *(StateSnapshot.take(None, optimizer) for optimizer in optimizers[1:])]


def _restore(snapshots: list[StateSnapshot]) -> None:
    for snapshot in snapshots:
        snapshot.restore()


def _forget_dataloaders(trainer: pl.Trainer) -> None:
    """Drop the cached train and val loaders: the fit loop rebuilds them (at the current
    batch size) when it next runs, as it would have without the search."""
    trainer.fit_loop._combined_loader = None
    trainer.fit_loop.epoch_loop.val_loop._combined_loader = None


class _TrainerState:
    """What trial fits change in the trainer, kept in memory and put back."""

    def __init__(self, trainer: pl.Trainer):
        loop = trainer.fit_loop
        self.loggers = trainer.loggers
        self.callbacks = trainer.callbacks
        self.max_steps = loop.epoch_loop.max_steps
        self.max_epochs = loop.max_epochs
        self.limit_train_batches = trainer.limit_train_batches
        self.limit_val_batches = trainer.limit_val_batches
        self.should_stop = trainer.should_stop
        self.loop_state = deepcopy(loop.state_dict())
        self.schedulers = [deepcopy(config.scheduler.state_dict())
                           for config in trainer.lr_scheduler_configs]
        self.precision = deepcopy(trainer.precision_plugin.state_dict())

    def prepare_trials(self, trainer: pl.Trainer, steps: int) -> None:
        """``steps`` optimizer steps per trial, across epoch ends; no validation, no
        callbacks, no logging."""
        trainer.logger = DummyLogger() if trainer.logger is not None else None
        trainer.callbacks = []
        trainer.limit_train_batches = 1.0
        trainer.limit_val_batches = 0
        trainer.fit_loop.epoch_loop.max_steps = steps
        trainer.fit_loop.max_epochs = -1

    def rewind(self, trainer: pl.Trainer) -> None:
        """Back to the fit's start: loop progress, schedulers, the precision plugin."""
        loop = trainer.fit_loop
        loop.load_state_dict(deepcopy(self.loop_state))
        loop.restarting = False
        if trainer.lightning_module.automatic_optimization:
            loop.epoch_loop.automatic_optimization.optim_progress.reset()
        else:
            loop.epoch_loop.manual_optimization.optim_step_progress.reset()
        loop.epoch_progress.reset()
        trainer.should_stop = False
        for config, state in zip(trainer.lr_scheduler_configs, self.schedulers):
            config.scheduler.load_state_dict(deepcopy(state))
        if self.precision:  # an empty state (no scaler) cannot be loaded
            trainer.precision_plugin.load_state_dict(deepcopy(self.precision))

    def restore(self, trainer: pl.Trainer) -> None:
        """Everything as it was before the search."""
        trainer.loggers = self.loggers
        trainer.callbacks = self.callbacks
        trainer.fit_loop.epoch_loop.max_steps = self.max_steps
        trainer.fit_loop.max_epochs = self.max_epochs
        trainer.limit_train_batches = self.limit_train_batches
        trainer.limit_val_batches = self.limit_val_batches
        self.rewind(trainer)
        trainer.should_stop = self.should_stop
        trainer._logger_connector.reset_results()  # the trials' logged values
        trainer._logger_connector.reset_metrics()


class NoiseScaleLogger(Callback):
    """Log the gradient noise scale ``B_simple`` (and its parts) while ``trainer.fit`` runs.

    It reads the gradients the fit computes anyway (see
    :class:`batchfit.stats.NoiseScaleMonitor`): each accumulated micro-batch's gradient on
    each rank (before DDP's all-reduce) is a small batch, their average the big one, read
    before the precision plugin unscales and clips it; the GradScaler's scale and Lightning's
    division of the loss by ``accumulate_grad_batches`` are undone. So it needs two or more
    gradients per optimizer step: ``Trainer(accumulate_grad_batches=2)`` (halve the
    dataloader's batch size to keep the same update), or DDP over several devices.

    Every ``log_every_n_steps`` optimizer steps (the trainer's unless given) it logs
    ``noise/b_simple``, ``noise/grad_sq_norm``, ``noise/trace_sigma`` and the interval's
    ends through the module's loggers; :attr:`result` holds the whole-run estimate after
    the fit.

    Args:
        every: measure one optimizer step in ``every``.
        ema_decay: decay per measured step of each part's moving average (None: a plain
            mean over the run).
        log_every_n_steps: logging period in optimizer steps (default: the trainer's).
        prefix: of the logged names.

    Attributes:
        monitor: the :class:`~batchfit.stats.NoiseScaleMonitor` during the fit.
        result: the :class:`~batchfit.stats.NoiseScale` at the end of the fit.

    Raises:
        InvalidInputError: at ``fit`` start: one gradient per step (no accumulation, one
            device), manual optimization, or sharded gradients (FSDP, DeepSpeed).

    Example:
        >>> import torch, lightning.pytorch as pl
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> class Net(pl.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.layer = torch.nn.Linear(8, 1)
        ...     def training_step(self, batch, batch_idx):
        ...         return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])
        ...     def configure_optimizers(self):
        ...         return torch.optim.SGD(self.parameters(), lr=0.01)
        >>> data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
        >>> noise = NoiseScaleLogger()
        >>> trainer = pl.Trainer(max_steps=10, accumulate_grad_batches=4, callbacks=[noise],
        ...                      logger=False, enable_checkpointing=False,
        ...                      enable_progress_bar=False, enable_model_summary=False)
        >>> trainer.fit(Net(), DataLoader(data, batch_size=8))
        >>> noise.result.steps, noise.result.batch_small, noise.result.batch_big
        (10, 8, 32)
    """

    def __init__(self, *, every: int = 1, ema_decay: float | None = 0.99,
                 log_every_n_steps: int | None = None, prefix: str = "noise/") -> None:
        from batchfit.stats.estimator import check_ema_decay

        check_positive_int(every, "every")
        if log_every_n_steps is not None:
            check_positive_int(log_every_n_steps, "log_every_n_steps")
        check_ema_decay(ema_decay)
        self.every = every
        self.ema_decay = ema_decay
        self.log_every_n_steps = log_every_n_steps
        self.prefix = prefix
        self.monitor: Any = None
        self.result: Any = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from batchfit.stats.monitor import NoiseScaleMonitor

        if not pl_module.automatic_optimization:
            raise InvalidInputError(
                "NoiseScaleLogger follows Lightning's automatic optimization; with manual "
                "optimization use batchfit.stats.NoiseScaleMonitor in training_step")
        steps = trainer.accumulate_grad_batches
        if steps * trainer.world_size < 2:
            raise InvalidInputError(
                "NoiseScaleLogger needs two or more gradients per optimizer step: use "
                "Trainer(accumulate_grad_batches=2) with half the batch size, or DDP over "
                "several devices")
        self.monitor = NoiseScaleMonitor(
            trainer.strategy.model or pl_module, every=self.every, ema_decay=self.ema_decay,
            grad_scaler=getattr(trainer.precision_plugin, "scaler", None),
            accumulation_steps=lambda: trainer.accumulate_grad_batches)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        from lightning.pytorch.utilities.data import extract_batch_size

        if self.monitor is not None:
            self.monitor.set_batch_size(extract_batch_size(batch))

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: Any) -> None:
        if self.monitor is None:
            return
        self.monitor.step()
        period = self.log_every_n_steps or trainer.log_every_n_steps
        if (trainer.global_step + 1) % period == 0 and trainer.loggers:
            metrics = {self.prefix + k: v for k, v in self.monitor.metrics().items()}
            if metrics:
                pl_module.log_dict(metrics, on_step=True, on_epoch=False, sync_dist=False)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self.monitor is not None:
            self.result = self.monitor.result()
            self.monitor.close()
            self.monitor = None
