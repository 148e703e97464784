"""batchfit.integrations.keras.BatchSizeFinder inside ``model.fit``.

On the torch backend (this process): a layer that raises torch's out-of-memory error above
batch 24 stands in for a device that runs out (the search's answer is known by
construction), and the fit that follows must be bit for bit the fit at that batch size run
by hand (no dropout there: its masks come from the global RNG stream, whose position two
separate fits reach differently; the snapshot's RNG restore is checked on its own). On JAX (a subprocess with ``KERAS_BACKEND=jax`` and a real ``RLIMIT_DATA`` cap):
XLA's own out-of-memory error is caught, and the fit after the search is bit for bit the
fit without it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

keras = pytest.importorskip("keras")  # optional (the GPU machine lacks it): skip, not error

from batchfit.integrations.keras import BatchSizeFinder

SRC = Path(__file__).resolve().parents[2] / "src"


class Guard(keras.layers.Layer):
    """Raises the CUDA allocator's error for a real batch above ``limit`` (not for the
    symbolic or fake tensors of Keras's shape inference and batchfit's trace)."""

    def __init__(self, limit: int = 24, **kwargs):
        super().__init__(**kwargs)
        self.limit = limit

    def call(self, x):
        from torch._subclasses.fake_tensor import FakeTensor

        real = x.device.type != "meta" and not isinstance(x, FakeTensor)
        if real and x.shape[0] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return x


def build(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((8,)), Guard(), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    return model


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((64, 8)).astype("float32"), rng.standard_normal((64, 1)).astype(
        "float32")


def test_finder_trains_at_the_found_batch_exactly_as_by_hand(capsys) -> None:
    x, y = data()
    model = build()
    finder = BatchSizeFinder(predicted=20, headroom=0.0)
    history = model.fit(x, y, epochs=2, batch_size=10, shuffle=False, verbose=0,
                        callbacks=[finder])
    assert finder.batch_size == 24 and finder.search.confirmed
    assert min(t.batch_size for t in finder.search.trials if not t.fits) == 25
    lines = capsys.readouterr().err.splitlines()
    assert sum("BatchSizeFinder: batch" in line for line in lines) == len(finder.search.trials)

    by_hand = build()
    expected = by_hand.fit(x, y, epochs=2, batch_size=24, shuffle=False, verbose=0)
    # 64 samples at 24: steps of 24, 24, 16 per epoch; the trials left no trace in the
    # weights, the Adam slots and step count, the metrics or the dropout seed
    assert int(model.optimizer.iterations.numpy()) == int(by_hand.optimizer.iterations.numpy()) == 6
    for ours, theirs in zip(model.variables + model.optimizer.variables,
                            by_hand.variables + by_hand.optimizer.variables):
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
    assert history.history["loss"] == expected.history["loss"]
    assert model.train_function is not None and not hasattr(model.train_function, "finder")


def test_snapshot_puts_back_every_variable_and_the_rngs() -> None:
    import random

    from batchfit.integrations.keras import _all_variables, _KerasSnapshot

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                              keras.layers.Dropout(0.5), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    x, y = data()
    model.train_on_batch(x[:8], y[:8])  # optimizer slots, metrics, dropout seed all moved
    before = [v.numpy().copy() for v in _all_variables(model)]
    rngs = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    snapshot = _KerasSnapshot(model)
    for _ in range(3):
        model.train_on_batch(x, y)
    random.random(), np.random.rand(), torch.rand(1)
    snapshot.restore()
    for value, variable in zip(before, _all_variables(model)):
        np.testing.assert_array_equal(value, variable.numpy())
    assert random.getstate() == rngs[0]
    assert np.array_equal(np.random.get_state()[1], rngs[1])
    assert torch.equal(torch.get_rng_state(), rngs[2])


def test_finder_report_only_keeps_fits_batch() -> None:
    x, y = data()
    model = build()
    finder = BatchSizeFinder(predicted=20, headroom=0.25, rebatch=False, verbose=False)
    model.fit(x, y, epochs=1, batch_size=16, shuffle=False, verbose=0, callbacks=[finder])
    assert finder.search.max_batch_size == 24 and finder.batch_size == 18  # 24 * 0.75
    assert int(model.optimizer.iterations.numpy()) == 4  # fit's own 64 / 16


@pytest.mark.slow
def test_finder_predicts_from_the_model_on_the_cpu() -> None:
    # no predicted=: batchfit traces a copy of the model for a CPU budget of 256 MiB (the
    # tiny model fits thousands there), then the guard's failures bring the search down
    x, y = data()
    model = build()
    finder = BatchSizeFinder(memory_bytes=256 << 20, headroom=0.0, verbose=False)
    model.fit(x, y, epochs=1, batch_size=8, shuffle=False, verbose=0, callbacks=[finder])
    assert finder.search.predicted_max_batch_size > 1000
    assert finder.batch_size == 24 and finder.search.confirmed


def test_finder_rejects_bad_options() -> None:
    from batchfit.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="steps_per_trial"):
        BatchSizeFinder(steps_per_trial=1)


JAX_SCRIPT = textwrap.dedent("""
    import json, resource, sys
    import keras, numpy as np
    from batchfit.integrations.keras import BatchSizeFinder

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(2048, activation="relu"),
                                  keras.layers.Dense(2048, activation="relu"),
                                  keras.layers.Dense(2048, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
        return model

    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 16)).astype("float32")
    y = rng.integers(0, 10, 256)
    model = build()
    finder = BatchSizeFinder(predicted=4096, memory_bytes=int(sys.argv[1]), max_trials=2)
    model.fit(x, y, epochs=1, batch_size=64, shuffle=False, verbose=0, callbacks=[finder])
    plain = build()
    plain.fit(x, y, epochs=1, batch_size=64, shuffle=False, verbose=0)
    same = all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(model.variables + model.optimizer.variables,
                               plain.variables + plain.optimizer.variables))
    print(json.dumps({"trials": [[t.batch_size, t.fits, t.error] for t in finder.search.trials],
                      "max": finder.search.max_batch_size, "same": same}))
""")


@pytest.mark.slow
def test_finder_on_jax_catches_xla_out_of_memory_and_restores_exactly(tmp_path) -> None:
    pytest.importorskip("jax")
    import json

    script = tmp_path / "jax_finder.py"
    script.write_text(JAX_SCRIPT)
    # one thread and synchronous dispatch: under RLIMIT_DATA every allocation can fail, and
    # one in a worker thread of XLA's pool (not the buffer whose failure XLA reports as
    # RESOURCE_EXHAUSTED) can leave the process waiting forever; with one thread the
    # failing allocation is the buffer's, on the calling thread
    env = {**os.environ, "KERAS_BACKEND": "jax", "PYTHONPATH": str(SRC),
           "JAX_CPU_ENABLE_ASYNC_DISPATCH": "false",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=1 "
                        "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"}
    # the model's variables hold ~100 MiB (weights and Adam's slots); a 300 MiB budget has
    # no room for batch 3686 (XLA asks for one 218 MiB buffer there, measured); 2 trials
    # (3686 runs out, half of it fits) are enough to see a failure caught and the state
    # put back, with the fewest out-of-memory errors
    done = subprocess.run([sys.executable, str(script), str(300 << 20)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    failed = [t for t in result["trials"] if not t[1]]
    assert [t[0] for t in failed] == [3686], result
    assert all("RESOURCE_EXHAUSTED" in t[2] for t in failed), result
    assert result["max"] == 1843  # 4096 - ceil(0.1 * 4096) failed; half of it ran
    assert result["same"], "the fit after the search differs from the fit without it"
