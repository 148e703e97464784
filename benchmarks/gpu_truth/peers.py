"""Lightning's batch-size finder on the card, for the ``search --device cuda`` path.

``Tuner(trainer).scale_batch_size(module, mode="binsearch", steps_per_trial=2,
init_val=2)`` (its defaults otherwise) in one process capped like the kit's trials
(``set_per_process_memory_fraction``), on the kit row's own step (the same model, input,
optimizer, precision and layout, through batchfit's step driver), as
``benchmarks/search_vs_peers.py`` runs it on a capped CPU. Lightning's trials are read
from its ``train_dataloader()`` calls (one per trial; the reset after the search is one
more). Prints one JSON object: answer, trials, wall time of the finder call.

Usage: python3 -m benchmarks.gpu_truth.peers KEY   (a row key of configs.CONFIGS)
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from typing import Any

from benchmarks.gpu_truth.configs import CONFIGS, Config

STEPS = 2


def lightning_binsearch(config: Config) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.tuner import Tuner

    from batchfit.realrun.trial import _StepSetup, cuda_memory_cap

    factory, inputs, train_config = config.trial_setup()
    torch.backends.cudnn.benchmark = config.cudnn_benchmark
    device = torch.device("cuda:0")
    with cuda_memory_cap(device, config.cap_bytes):
        setup = _StepSetup.of(inputs, train_config, device)
        generator = torch.Generator(device=device).manual_seed(0)
        runner = setup.runner(setup.prepare(setup.build(factory)), None, generator)

        class Batches(torch.utils.data.IterableDataset):
            def __init__(self, batch_size: int) -> None:
                self.batch_size = batch_size

            def __iter__(self):
                for _ in range(1000):
                    yield setup.batch(self.batch_size, generator)

        class Module(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.model = runner.model
                self.batch_size = 2
                self.trials: list[dict[str, Any]] = []

            def train_dataloader(self):
                self.trials.append({"batch_size": self.batch_size, "steps": 0})
                return torch.utils.data.DataLoader(Batches(self.batch_size), batch_size=None)

            def training_step(self, batch, index):
                runner.batch = batch
                try:
                    return runner.forward_loss()
                finally:
                    runner.batch = ((), {})

            def on_train_batch_end(self, *args: Any) -> None:
                self.trials[-1]["steps"] += 1

            def configure_optimizers(self):
                return runner.optimizer

        module = Module()
        with tempfile.TemporaryDirectory() as root:
            trainer = pl.Trainer(accelerator="cuda", devices=1, max_epochs=1, logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False,
                                 enable_model_summary=False, default_root_dir=root)
            start = time.perf_counter()
            try:
                answer = Tuner(trainer).scale_batch_size(module, mode="binsearch",
                                                         steps_per_trial=STEPS, init_val=2)
                error = None
            except Exception as exc:  # noqa: BLE001 - a finder that crashes is a result too
                answer, error = None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            wall = time.perf_counter() - start
    trials = [{"batch_size": t["batch_size"], "fits": t["steps"] >= STEPS} for t in module.trials]
    return {"answer": answer, "trials": trials, "wall_s": round(wall, 2), "error": error}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    configs = {c.key: c for c in CONFIGS}
    if len(argv) != 1 or argv[0] not in configs:
        print("usage: python3 -m benchmarks.gpu_truth.peers KEY (a key of configs.CONFIGS)",
              file=sys.stderr)
        return 2
    print(json.dumps(lightning_binsearch(configs[argv[0]])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
