"""Speed: which batch runs fastest (layer 5).

Owns the measured sweep (:mod:`~batchfit.speed.bench`, its results in
:mod:`~batchfit.speed.bench_result`) with its torch-free decisions
(:mod:`~batchfit.speed.knee`: knee, batch grid, the next batch to measure, alignment)
and how one step is timed (:mod:`~batchfit.speed.timing`); and the prediction of step
time without the device: the roofline (:mod:`~batchfit.speed.roofline`) over the traced
ops' costs (:mod:`~batchfit.speed.op_costs`), with the rates of a catalog GPU
(:mod:`~batchfit.speed.rates`) or of this CPU measured kind by kind
(:mod:`~batchfit.speed.cpu_profile`), and GEMM tile and wave quantization
(:mod:`~batchfit.speed.gemm`).

May import: :mod:`batchfit.realrun` and everything below it.
"""
