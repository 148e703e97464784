"""First-hand GPU truth (issue 39): one command that measures, on a lent H100/H200, the
exact out-of-memory boundaries of 43 configurations, memory snapshots at four of them, and
every CUDA code path of batchfit, within a time budget; resumable; with a CPU dry run.

On the device tool (the working tree travels; the device's ``python3`` has torch 2.11 +
CUDA 13.0, timm, transformers, lightning, typer, rich and pytest, not this virtualenv)::

    set -o pipefail; export PYTHONPATH=src PYTHONUNBUFFERED=1;
    python3 -m benchmarks.gpu_truth --budget-s 480 2>&1 | tee $OUT/kit.log

with ``timeout_s`` 570 (the budget, the imports, the writing). It writes into ``$OUT``
six files (:mod:`.results`): ``boundaries.csv``, ``trials.jsonl``, ``paths.json``,
``run.json``, ``snapshots.tar.gz`` and ``kit.log``. Commit them as
``benchmarks/results/gpu/<device>-<date>/`` (``run.json`` names the device): a second run
resumes from the newest such folder of the same device, replaying its trials.

Parts, in priority order and side by side where the card allows:

1. the CUDA paths (:mod:`.paths`): ``search --device cuda`` on 3 rows beside Lightning's
   binsearch (:mod:`.peers`), ``bench --device cuda`` beside ``bench --predict``,
   ``noise --device cuda``, ``pytest -m gpu`` (the callbacks' CUDA bit-exact tests among
   them), and ``estimate --snapshot`` once a snapshot exists;
2. the boundaries (:mod:`.search`): per row, batchfit's answer for the cap alone
   (:mod:`.predict`, committed in ``predictions.csv``) is tried first, then +/-1, then a
   gallop and a bisection to ``failed_at == boundary + 1``; each trial is a fresh CUDA
   process forked from a parent that imported the libraries but never CUDA (:mod:`.pool`),
   capped with ``set_per_process_memory_fraction(cap / total)``, two steady steps of
   batchfit's own step (:mod:`.trials`);
3. the snapshots: one steady step at the boundary of ConvNeXt-T 384, BiT-R101x3, EVA02-L
   448 and seresnet152d 256 recorded with ``_record_memory_history`` (python stacks,
   bounded entries). Diff them here afterwards against batchfit's predicted step:
   ``python3 -m benchmarks.gpu_truth.snapshot_diff RUN_FOLDER`` (:mod:`.snapshot_diff`,
   ``batchfit estimate --snapshot`` per snapshot, :mod:`batchfit.device.snapshot`).

Afterwards, here: ``python3 -m benchmarks.gpu_truth.report
benchmarks/results/gpu/*/boundaries.csv`` scores each run (in / above / below on the
exact rows). After a change to the engine, ``python3 -m benchmarks.gpu_truth.predict
--stale`` recomputes the predictions made by older code (each row keeps its commit and
its ``batchfit max`` command).

``--dry-run`` runs the whole pipeline on the CPU: three tiny rows under the project's CPU
trial cap (``RLIMIT_DATA``), the cheapest path commands, a stand-in snapshot
(``tests/test_gpu_truth.py`` runs it).

Known limitations:
    * Concurrent trials share the card's SMs: cuDNN's benchmark mode times its candidate
      algorithms under that load, so it may keep others (and other workspaces) than on
      an idle card.
    * A trial that times out or crashes is not retried in the same run (the next run
      retries it); a row whose trials contradict each other (a failure below a fit) stops
      with status ``contradicted``.
    * Keras is not on the device: its callback's CUDA test skips unless Keras travels as
      wheels (README, "First-hand GPU truth").
"""
