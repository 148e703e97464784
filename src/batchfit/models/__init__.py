"""Models: turn what a user names (``timm:resnet50``, ``hf:gpt2``, ``file.py:factory``)
into a zero-argument factory and an input spec (layer 2).

Owns the MODEL-string resolution (:mod:`~batchfit.models.resolve`; model files in
:mod:`~batchfit.models.files`) and the offline
table of Hugging Face configs (:mod:`~batchfit.models.hf_configs`): nothing is ever
downloaded.

May import: :mod:`batchfit.engine` (input specs) and the top level.
"""
