"""The noise-scale callbacks for Lightning and the Hugging Face Trainer.

Each trains a linear regression with 4 accumulated micro-batches of 8 in data order; with
``ema_decay=None`` and one optimizer step, the callback's estimate is that step's, which is
computed here by hand from the four micro-batches' own gradients (``torch.autograd.grad`` of
each micro-batch's mean loss): the frameworks' division of the loss by the accumulation
steps is undone correctly. Training itself is unchanged by the callback (bit for bit), and
a step with one gradient is refused with one clear error.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from batchfit.errors import InvalidInputError
from batchfit.stats.estimator import two_batch_estimates

MICRO, SIZE = 4, 8


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 5, generator=g)
    return x, x.sum(1, keepdim=True) + torch.randn(64, 1, generator=g)


def _expected(layer: nn.Linear) -> tuple[float, float]:
    """The first step's (|G|^2, tr Σ) from the first four micro-batches in data order."""
    x, y = _data()
    grads = []
    for j in range(MICRO):
        part = slice(j * SIZE, (j + 1) * SIZE)
        loss = nn.functional.mse_loss(layer(x[part]), y[part])
        grads.append(torch.cat([g.flatten() for g in torch.autograd.grad(
            loss, list(layer.parameters()))]))
    small = sum(float(g.square().sum()) for g in grads) / MICRO
    big = float(torch.stack(grads).mean(0).square().sum())
    return two_batch_estimates(small, big, SIZE, SIZE * MICRO)


# --------------------------------------------------------------------------- Lightning


@pytest.fixture(scope="module")
def pl():
    pytest.importorskip("lightning")
    import lightning.pytorch as pl

    return pl


def _lightning_module(pl):
    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layer = nn.Linear(5, 1)

        def training_step(self, batch, batch_idx):
            return nn.functional.mse_loss(self.layer(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return Regression()


class _Recorder:
    """A Lightning logger that keeps what it is given."""

    def __init__(self, pl) -> None:
        from lightning.pytorch.loggers.logger import Logger

        class Recorder(Logger):
            name, version = "recorder", 0

            def __init__(self) -> None:
                super().__init__()
                self.metrics: list[dict] = []

            def log_metrics(self, metrics, step=None):
                self.metrics.append(dict(metrics))

            def log_hyperparams(self, params, *args, **kwargs):
                pass

        self.logger = Recorder()


def _fit(pl, module, callbacks, root, *, accumulate: int = MICRO, max_steps: int = 1,
         logger=False):
    trainer = pl.Trainer(max_steps=max_steps, accumulate_grad_batches=accumulate,
                         callbacks=callbacks, logger=logger, log_every_n_steps=1,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(root))
    trainer.fit(module, DataLoader(TensorDataset(*_data()), batch_size=SIZE))
    return trainer


def test_lightning_step_matches_the_micro_batches_own_gradients(pl, tmp_path):
    from batchfit.integrations.lightning import NoiseScaleLogger

    module = _lightning_module(pl)
    expected = _expected(copy.deepcopy(module.layer))
    noise = NoiseScaleLogger(ema_decay=None)
    recorder = _Recorder(pl).logger
    _fit(pl, module, [noise], tmp_path, logger=recorder)
    r = noise.result
    assert (r.steps, r.batch_small, r.batch_big, r.method) == (1, SIZE, SIZE * MICRO,
                                                                 "microbatch")
    assert r.grad_sq_norm == pytest.approx(expected[0], rel=1e-4)
    assert r.trace_sigma == pytest.approx(expected[1], rel=1e-4)
    logged = [m for m in recorder.metrics if "noise/b_simple" in m]
    assert logged and logged[-1]["noise/b_simple"] == pytest.approx(r.b_simple)


def test_lightning_training_is_unchanged_by_the_callback(pl, tmp_path):
    from batchfit.integrations.lightning import NoiseScaleLogger

    plain, watched = _lightning_module(pl), _lightning_module(pl)
    _fit(pl, plain, [], tmp_path / "a", max_steps=3)
    noise = NoiseScaleLogger()
    _fit(pl, watched, [noise], tmp_path / "b", max_steps=3)
    assert noise.result.steps == 3
    for a, b in zip(plain.parameters(), watched.parameters()):
        assert torch.equal(a, b)


def test_lightning_refuses_one_gradient_per_step(pl, tmp_path):
    from batchfit.integrations.lightning import NoiseScaleLogger

    with pytest.raises(InvalidInputError, match="accumulate_grad_batches=2"):
        _fit(pl, _lightning_module(pl), [NoiseScaleLogger()], tmp_path, accumulate=1)


# --------------------------------------------------------------------------- Hugging Face


@pytest.fixture(scope="module")
def hf():
    return pytest.importorskip("transformers")


class _HFRegression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(5, 1)

    def forward(self, x, y):
        return {"loss": nn.functional.mse_loss(self.layer(x), y)}


def _hf_trainer(hf, root, *, accumulate: int = MICRO, max_steps: int = 1):
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    class InOrder(hf.Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    x, y = _data()
    data = [{"x": x[i], "y": y[i]} for i in range(len(x))]
    args = hf.TrainingArguments(str(root), per_device_train_batch_size=SIZE,
                                gradient_accumulation_steps=accumulate, max_steps=max_steps,
                                learning_rate=0.05, lr_scheduler_type="constant",
                                logging_steps=1, report_to=[], use_cpu=True,
                                save_strategy="no", disable_tqdm=True)
    trainer = InOrder(_HFRegression(), args, train_dataset=data)
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    return trainer


def test_trainer_step_matches_the_micro_batches_own_gradients(hf, tmp_path):
    from batchfit.integrations.huggingface import NoiseScaleCallback

    trainer = _hf_trainer(hf, tmp_path)
    expected = _expected(copy.deepcopy(trainer.model.layer))
    noise = NoiseScaleCallback(trainer, ema_decay=None)
    trainer.add_callback(noise)
    trainer.train()
    r = noise.result
    assert (r.steps, r.batch_small, r.batch_big) == (1, SIZE, SIZE * MICRO)
    assert r.grad_sq_norm == pytest.approx(expected[0], rel=1e-4)
    assert r.trace_sigma == pytest.approx(expected[1], rel=1e-4)
    logged = [h for h in trainer.state.log_history if "noise/b_simple" in h]
    assert logged and logged[-1]["noise/b_simple"] == pytest.approx(r.b_simple)


def test_trainer_training_is_unchanged_by_the_callback(hf, tmp_path):
    from batchfit.integrations.huggingface import NoiseScaleCallback

    plain = _hf_trainer(hf, tmp_path / "a", max_steps=3)
    plain.train()
    watched = _hf_trainer(hf, tmp_path / "b", max_steps=3)
    noise = NoiseScaleCallback(watched)
    watched.add_callback(noise)
    watched.train()
    assert noise.result.steps == 3
    for a, b in zip(plain.model.parameters(), watched.model.parameters()):
        assert torch.equal(a, b)


def test_trainer_refuses_one_gradient_per_step(hf, tmp_path):
    from batchfit.integrations.huggingface import NoiseScaleCallback

    trainer = _hf_trainer(hf, tmp_path, accumulate=1)
    trainer.add_callback(NoiseScaleCallback(trainer))
    with pytest.raises(InvalidInputError, match="gradient_accumulation_steps=2"):
        trainer.train()


def test_callbacks_docstring_examples_run(pl, hf):
    import doctest

    from batchfit.integrations import huggingface, lightning

    for module, name in ((lightning, "NoiseScaleLogger"), (huggingface, "NoiseScaleCallback")):
        finder = doctest.DocTestFinder()
        runner = doctest.DocTestRunner()
        for test in finder.find(getattr(module, name), name, globs=vars(module)):
            runner.run(test)
        assert runner.failures == 0, name
