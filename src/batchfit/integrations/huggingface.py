"""Set a Hugging Face ``Trainer``'s batch size from batchfit's search before training.

Why a function and not a ``TrainerCallback``: in transformers 5.x ``Trainer.train()`` builds
the train dataloader (from ``trainer._train_batch_size``) and derives the step counts from
it inside ``_inner_training_loop``, *before* the first callback event that could act
(``on_train_begin``); ``on_init_end`` happens before there is a trainer to reach. A
callback can only see the batch size, never change it. So call
:func:`find_trainer_batch_size` between building the trainer and ``trainer.train()``.

A trial at batch B is the trainer's own step, ``steps_per_trial`` times: a batch from
``trainer.get_train_dataloader()`` at B (the trainer's collator, sampler and column
removal), ``trainer.training_step`` (its autocast, loss, loss scaling and
``accelerator.backward``), ``optimizer.step()`` and ``model.zero_grad()``, as
``Trainer._run_epoch`` does. Trials run on the unwrapped model (a single device; no DDP,
FSDP or DeepSpeed), without the learning-rate scheduler (it holds no memory).
The optimizer is the trainer's: ``trainer.create_optimizer()`` when there is none yet, and
it is dropped again afterwards, so ``train()`` creates and prepares a fresh one; one you
passed to the ``Trainer`` is used and restored. The model's parameters, buffers, gradients
and train/eval flags and the RNG states are restored bit for bit (in memory; nothing is
written to disk), so ``trainer.train()`` afterwards is the run you would get with
``per_device_train_batch_size`` set by hand.

``auto_find_batch_size=True`` still works on top: ``train()`` then starts from the batch
size set here and only shrinks it if a later step runs out of memory.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

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
    search_in_process,
)
from batchfit.realrun.state import StateSnapshot

try:  # the noise-scale callback's base; without transformers there is no Trainer to use
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover - depends on the environment
    TrainerCallback = object  # type: ignore[assignment,misc]

_MISSING = object()


@dataclass(frozen=True)
class TrainerBatchSizes:
    """What :func:`find_trainer_batch_size` found and set.

    Attributes:
        train: the search for ``per_device_train_batch_size``.
        evaluation: the search for ``per_device_eval_batch_size`` (None: not searched).
    """

    train: BatchSizeSearch
    evaluation: BatchSizeSearch | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"train": self.train.to_dict(),
                "evaluation": None if self.evaluation is None else self.evaluation.to_dict()}


def find_trainer_batch_size(trainer: Any, *, predicted: int | None = None, device: Any = None,
                            memory_bytes: int | None = None, steps_per_trial: int = 2,
                            max_trials: int = 32, headroom: float = 0.05, approach: float = 0.1,
                            max_batch_size: int = 8192,
                            search_eval: bool = False) -> TrainerBatchSizes:
    """Find the largest per-device batch size that trains and set it on ``trainer``.

    Sets ``trainer.args.per_device_train_batch_size`` (and ``trainer._train_batch_size``,
    what ``train()`` reads) to the largest batch that ran less ``headroom``; with
    ``search_eval``, also ``per_device_eval_batch_size`` from trials of
    ``trainer.prediction_step`` on the eval dataset.

    Args:
        trainer: a ``transformers.Trainer`` with a ``train_dataset``.
        predicted: skip the prediction and start from this batch size.
        device: the prediction's target: a catalog GPU name, a
            :class:`~batchfit.DeviceProfile` or ``"cpu"``. Default: the GPU the trainer
            uses; on the CPU there is no prediction unless ``memory_bytes`` is given.
        memory_bytes: the prediction's memory budget (overrides the device's).
        steps_per_trial: steps per trial (>= 2: the first creates the optimizer state).
        max_trials: trials at most per search; when they run out, the largest batch that
            ran is used (``confirmed`` is then False).
        headroom: the batch size set is the largest that ran, less this fraction.
        approach: the first trial's margin below the prediction, a fraction of it.
        max_batch_size: never try more (the dataset's length also caps it).
        search_eval: also search the evaluation batch size.

    Returns:
        The searches, with their trials.

    Raises:
        InvalidInputError: a bad option, no train dataset, or more than one device.
        DoesNotFitError: even batch size 1 ran out of memory.

    Example:
        >>> import tempfile, torch
        >>> from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
        >>> model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
        ...                                    n_positions=8, bos_token_id=0, eos_token_id=0))
        >>> data = [{"input_ids": torch.randint(0, 64, (8,))} for _ in range(16)]
        >>> data = [{**sample, "labels": sample["input_ids"]} for sample in data]
        >>> args = TrainingArguments(tempfile.mkdtemp(), use_cpu=True, report_to=[],
        ...                          max_steps=2, per_device_train_batch_size=4)
        >>> trainer = Trainer(model=model, args=args, train_dataset=data)
        >>> found = find_trainer_batch_size(trainer, predicted=16)
        >>> [t.batch_size for t in found.train.trials], found.train.capped
        ([14, 16], True)
        >>> trainer.args.per_device_train_batch_size  # all 16 samples fit: no headroom
        16
    """
    if predicted is not None:
        check_positive_int(predicted, "predicted")
    if memory_bytes is not None:
        check_positive_int(memory_bytes, "memory_bytes")
    check_steps(steps_per_trial)
    limits = SearchLimits(max_batch_size=max_batch_size, max_trials=max_trials,
                          approach=approach, headroom=headroom)
    _check_trainer(trainer, search_eval)
    args = trainer.args
    started = time.perf_counter()
    owns_optimizer = trainer.optimizer is None
    if owns_optimizer:
        trainer.create_optimizer()
    snapshot = StateSnapshot.take(trainer.model, None if owns_optimizer else trainer.optimizer)
    accumulation = getattr(trainer, "current_gradient_accumulation_steps", _MISSING)
    train_size, eval_size = args.per_device_train_batch_size, args.per_device_eval_batch_size
    try:
        trainer.current_gradient_accumulation_steps = 1  # one micro-batch per optimizer step
        target = (prediction_target(args.device, device, memory_bytes)
                  if predicted is None else None)
        train = _search(trainer, _TrainTrial(trainer, steps_per_trial), limits, predicted,
                        target, snapshot, owns_optimizer, started)
        train_size = train.recommended_batch_size
        evaluation = None
        if search_eval:
            evaluation = _search(trainer, _EvalTrial(trainer, steps_per_trial), limits,
                                 None, None, snapshot, owns_optimizer, None)
            eval_size = evaluation.recommended_batch_size
    finally:
        if owns_optimizer:
            trainer.optimizer = None
        if accumulation is _MISSING:
            vars(trainer).pop("current_gradient_accumulation_steps", None)
        else:
            trainer.current_gradient_accumulation_steps = accumulation
        args.per_device_train_batch_size = train_size
        args.per_device_eval_batch_size = eval_size
        trainer._train_batch_size = args.train_batch_size
        snapshot.restore()  # last: the dataloaders above may draw random numbers
    return TrainerBatchSizes(train, evaluation)


def _check_trainer(trainer: Any, search_eval: bool) -> None:
    args = getattr(trainer, "args", None)
    if args is None or not callable(getattr(trainer, "training_step", None)):
        raise InvalidInputError(f"expected a transformers.Trainer, not {type(trainer).__name__}")
    if trainer.train_dataset is None:
        raise InvalidInputError("the trainer has no train_dataset: pass train_dataset= to Trainer")
    if search_eval and trainer.eval_dataset is None:
        raise InvalidInputError("search_eval=True needs an eval_dataset on the trainer")
    if args.n_gpu > 1 or args.world_size > 1:
        raise InvalidInputError(
            "find_trainer_batch_size searches one device; with several (DataParallel or "
            "distributed) run it in a single-device process and set the per-device size")


class _TrainTrial:
    """``steps`` steps of the trainer's training loop at one batch size."""

    def __init__(self, trainer: Any, steps: int):
        self.trainer, self.steps = trainer, steps
        self.dataset = trainer.train_dataset
        self.start = trainer.args.per_device_train_batch_size

    def loader(self, batch_size: int) -> Any:
        self.trainer._train_batch_size = batch_size
        return self.trainer.get_train_dataloader()

    def __call__(self, batch_size: int) -> None:
        trainer = self.trainer
        model, optimizer = trainer.model, trainer.optimizer
        for inputs, items in _batches(trainer, self.loader(batch_size), self.steps):
            trainer.training_step(model, inputs, items)
            optimizer.step()
            model.zero_grad()


class _EvalTrial:
    """``steps`` evaluation steps (``prediction_step``, loss only) at one batch size."""

    def __init__(self, trainer: Any, steps: int):
        self.trainer, self.steps = trainer, steps
        self.dataset = trainer.eval_dataset
        self.start = trainer.args.per_device_eval_batch_size

    def loader(self, batch_size: int) -> Any:
        self.trainer.args.per_device_eval_batch_size = batch_size
        return self.trainer.get_eval_dataloader()

    def __call__(self, batch_size: int) -> None:
        trainer = self.trainer
        trainer.model.eval()
        for inputs, _ in _batches(trainer, self.loader(batch_size), self.steps):
            trainer.prediction_step(trainer.model, inputs, prediction_loss_only=True)


def _batches(trainer: Any, loader: Any, steps: int) -> Any:
    """``steps`` (batch, items in it) pairs, starting the loader again when it runs out."""
    iterator, produced = iter(loader), 0
    while produced < steps:
        batches, items = trainer.get_batch_samples(iterator, 1, trainer.args.device)
        if not batches:
            if produced == 0:
                raise InvalidInputError("the dataloader produced no batch")
            iterator = iter(loader)
            continue
        produced += 1
        yield batches[0], items


def _search(trainer: Any, trial: _TrainTrial | _EvalTrial, limits: SearchLimits,
            predicted: int | None, target: tuple[Any, int | None] | None,
            snapshot: StateSnapshot, owns_optimizer: bool,
            started: float | None) -> BatchSizeSearch:
    limits = limits.capped_at(trial.dataset)
    if predicted is None and target is not None:
        predicted = _predict(trainer, trial, target, limits.max_batch_size)
        snapshot.restore()  # reading the first batch moved the RNG

    def after_trial() -> None:
        snapshot.restore()
        if owns_optimizer:  # the state the trial's steps created in our optimizer
            trainer.optimizer.state.clear()

    search, _ = search_in_process(trial, limits, predicted=predicted, start=trial.start,
                                  after_trial=after_trial, started=started)
    return search


def _predict(trainer: Any, trial: _TrainTrial, target: tuple[Any, int | None],
             limit: int) -> int | None:
    """batchfit's prediction for the model, with the per-sample input read from the first
    batch the trainer's own dataloader makes (its collator pads and adds labels)."""
    who = "find_trainer_batch_size"
    batch = next(iter(trial.loader(trial.start)))
    structure = batch_structure(dict(batch) if hasattr(batch, "keys") else batch)
    if structure is None:
        warnings.warn(f"{who}: no prediction (the batch is not a dict or tuple of tensors); "
                      "the search starts without one", stacklevel=4)
        return None
    args = trainer.args
    precision = "amp-bf16" if args.bf16 else "amp-fp16" if args.fp16 else "fp32"
    checkpointing = bool(getattr(args, "activation_checkpointing", False)
                         or getattr(args, "gradient_checkpointing", False))
    config = TrainConfig(precision=precision, checkpointing=checkpointing,
                         **optimizer_options(trainer.optimizer))
    return predict(trainer.model, structure[0], config, target, limit, who)


class NoiseScaleCallback(TrainerCallback):
    """Log the gradient noise scale ``B_simple`` (and its parts) while ``trainer.train()`` runs.

    ``trainer.add_callback(NoiseScaleCallback(trainer))``. It reads the gradients training
    computes anyway (see :class:`batchfit.stats.NoiseScaleMonitor`): each accumulated
    micro-batch's gradient on each rank (before DDP's all-reduce) is a small batch, their
    average the big one, read at the end of the last backward, before the Trainer unscales
    and clips it (the Trainer clips before any callback event, so the hooks, not an event,
    read it). The fp16 GradScaler's scale and the Trainer's division of the loss by the
    accumulation steps are undone. It needs two or more gradients per optimizer step:
    ``gradient_accumulation_steps >= 2`` (halve ``per_device_train_batch_size`` to keep the
    same update) or several DDP processes.

    Every ``logging_steps`` it logs ``noise/b_simple``, ``noise/grad_sq_norm``,
    ``noise/trace_sigma`` and the interval's ends with ``trainer.log`` (so every reporting
    integration gets them); :attr:`result` holds the whole-run estimate after training.

    Args:
        trainer: the ``transformers.Trainer`` (its model, accelerator and arguments).
        every: measure one optimizer step in ``every``.
        ema_decay: decay per measured step of each part's moving average (None: plain mean).
        prefix: of the logged names.

    Raises:
        InvalidInputError: at ``train()`` start: one gradient per step, or DeepSpeed / FSDP
            (sharded gradients).

    Example:
        >>> import contextlib, io, tempfile, torch
        >>> from transformers import Trainer, TrainingArguments
        >>> class Reg(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.layer = torch.nn.Linear(8, 1)
        ...     def forward(self, x, y):
        ...         return {"loss": torch.nn.functional.mse_loss(self.layer(x), y)}
        >>> data = [{"x": torch.randn(8), "y": torch.randn(1)} for _ in range(256)]
        >>> args = TrainingArguments(tempfile.mkdtemp(), per_device_train_batch_size=8,
        ...                          gradient_accumulation_steps=4, max_steps=6,
        ...                          report_to=[], use_cpu=True, save_strategy="no",
        ...                          disable_tqdm=True)
        >>> with contextlib.redirect_stdout(io.StringIO()):  # the Trainer's own printing
        ...     trainer = Trainer(Reg(), args, train_dataset=data)
        ...     noise = NoiseScaleCallback(trainer)
        ...     trainer.add_callback(noise)
        ...     _ = trainer.train()
        >>> noise.result.steps, noise.result.batch_small, noise.result.batch_big
        (6, 8, 32)
    """

    def __init__(self, trainer: Any, *, every: int = 1, ema_decay: float | None = 0.99,
                 prefix: str = "noise/") -> None:
        from batchfit.stats.estimator import check_ema_decay

        check_positive_int(every, "every")
        check_ema_decay(ema_decay)
        self.trainer = trainer
        self.every = every
        self.ema_decay = ema_decay
        self.prefix = prefix
        self.monitor: Any = None
        self.result: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from batchfit.stats.monitor import NoiseScaleMonitor

        trainer = self.trainer
        if getattr(trainer, "is_deepspeed_enabled", False) or getattr(
                trainer, "is_fsdp_enabled", False):
            raise InvalidInputError(
                "DeepSpeed and FSDP shard the gradients across ranks: the noise scale needs "
                "each micro-batch's whole gradient (use DDP or one device)")
        world = max(1, int(getattr(args, "world_size", 1)))
        if args.gradient_accumulation_steps * world < 2:
            raise InvalidInputError(
                "NoiseScaleCallback needs two or more gradients per optimizer step: set "
                "gradient_accumulation_steps=2 (and halve per_device_train_batch_size), or "
                "train on several processes with DDP")
        group = None
        if world > 1:
            import torch.distributed as dist

            group = dist.group.WORLD if dist.is_initialized() else None

        def accumulation_steps() -> int:
            return getattr(trainer, "current_gradient_accumulation_steps", None) or \
                args.gradient_accumulation_steps

        self.monitor = NoiseScaleMonitor(
            trainer.model, every=self.every, ema_decay=self.ema_decay,
            grad_scaler=getattr(trainer.accelerator, "scaler", None),
            accumulation_steps=accumulation_steps, process_group=group)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is None:
            return
        self.monitor.step()
        period = getattr(state, "logging_steps", None) or args.logging_steps
        if period and state.global_step % period == 0:
            metrics = {self.prefix + k: v for k, v in self.monitor.metrics().items()}
            if metrics:
                self.trainer.log(metrics)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is not None:
            self.result = self.monitor.result()
            self.monitor.close()
            self.monitor = None
