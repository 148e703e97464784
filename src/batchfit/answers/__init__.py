"""Answers: the questions users ask, as pure functions over traces (layer 3).

Owns the memory estimate at a batch size (:mod:`~batchfit.answers.estimate`), the
largest batch or sequence length for a budget (:mod:`~batchfit.answers.maxbatch`),
the torch-free solver over peak(B) (:mod:`~batchfit.answers.solve`), and the forked
workers that trace two requests at once (:mod:`~batchfit.answers.tracepool`: a pair for
``max``, a queue for ``plan``).

May import: :mod:`batchfit.engine`, :mod:`batchfit.device`, :mod:`batchfit.models`
and the top level. Nothing here runs a real step.
"""
