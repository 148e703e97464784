"""Model specifications: turn the user's model string into a module factory and a default input.

Spec forms understood by :func:`resolve_model`:

- ``timm:NAME``: ``timm.create_model(NAME, pretrained=False, **kwargs)``. Default input: the
  ``input_size`` of the model's pretrained config (``img_size``/``in_chans`` kwargs adjust it).
- ``torchvision:NAME``: ``torchvision.models.get_model(NAME, weights=None, **kwargs)``.
  Default input: classification models use the crop size of their default torchvision
  weights (224; inception_v3 299; efficientnet_b7 600 ...), except ViT and MaxViT, which are
  built for ``image_size``/``input_size`` (224 unless given). Segmentation models take
  3x520x520 (the resize size of torchvision's segmentation weights; its training recipe
  crops 480). Video models take 3x16x(crop)x(crop): 16-frame clips as in torchvision's video
  recipe. Detection and optical-flow models take lists of images and targets, which an
  input spec cannot describe: they raise :class:`ModelSpecError` (wrap them in a factory file).
- ``hf:NAME``: a Hugging Face ``transformers`` model built from its config, never its
  weights. NAME is a local directory holding ``config.json``, or a hub id whose config.json
  is read from the local Hugging Face cache, the offline table of
  :mod:`batchfit.models.hf_configs`, or the hub (unless ``HF_HUB_OFFLINE`` is set), in that
  order (:mod:`batchfit.models.hub`). Causal LMs build ``AutoModelForCausalLM``; BERT-like encoders
  ``AutoModelForMaskedLM`` (pretraining-style memory: the vocabulary-sized logits dominate);
  T5 ``AutoModelForSeq2SeqLM``. The model kwarg ``task=`` picks another head
  (``causal-lm``, ``masked-lm``, ``seq2seq-lm``, ``sequence-classification``); the reserved
  kwarg ``attn_implementation=`` picks the attention (default ``sdpa``); every other kwarg
  overrides a config field (``num_hidden_layers=2``). ``use_cache`` defaults to False (a
  training step keeps no KV cache); pass ``use_cache=true`` to trace an inference forward
  that does.
- ``path/to/file.py:factory``: ``factory(**kwargs)`` from that file. It returns a module, a
  tuple ``(module, input_spec)`` or ``(module, input_spec, loss_fn)``, or a dict with keys
  ``model``, ``input_spec``, ``loss_fn``. ``input_spec`` is a :class:`TensorSpec`, a tuple of
  them (positional inputs), a dict of them (keyword inputs) or a plain shape tuple.
  :func:`resolve_model` calls the factory once, on meta, to read that input spec; the
  ``loss_fn`` it returns is kept from that call, so it must not hold on to the module.
  A batched integer tensor with a sequence axis marks a token model: ``seq_len`` then
  resizes every batched tensor whose first dimension matches it.
- No prefix: timm, then torchvision, then the HF table, then a local config directory.

HF inputs: ``input_ids`` of shape ``(seq_len,)`` drawn from ``[0, vocab_size)`` and
``labels`` equal in shape, so the model computes its own loss (``hf_labels=True``); T5's
decoder length equals ``seq_len``. No ``attention_mask``: batches are unpadded, the way
SDPA/flash take packed causal batches. A sequence-classification head takes one class label
per sample. Default ``seq_len``: ``min(positions, 512)`` for encoders and T5,
``min(positions, 4096)`` for causal LMs (GPT-2 1024, Llama-2 4096, Llama-3 4096).

Every factory is a picklable ``functools.partial`` over plain arguments, so a spec can be
shipped to a fresh process. Factories never download and create no tensor on a fixed
device: the engine calls them under ``with torch.device("meta")``.

Known limitations: timm and torchvision keyword arguments are checked only when the factory
runs (the error names the model and the exception); torchvision detection and optical-flow
models need a factory file; HF models with custom code (``trust_remote_code``) need one too.
"""

from __future__ import annotations

import ast
import copy
import difflib
import functools
import importlib
import importlib.util
import inspect
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchfit.engine.spec import InputSpec, TensorSpec, parse_enum
from batchfit.errors import BatchfitError, InvalidInputError, ModelSpecError, option
from batchfit.models import hub
from batchfit.models.hf_configs import find_hf_config, hf_config_names
from batchfit.models.modelspec import (  # noqa: F401 - re-exported: resolve's API
    HFTask,
    ModelSpec,
    _one_line,
    _tensor_specs,
    _token_tensor,
)

if TYPE_CHECKING:
    from torch import nn


_AUTO_CLASS = {
    HFTask.CAUSAL_LM: "AutoModelForCausalLM",
    HFTask.MASKED_LM: "AutoModelForMaskedLM",
    HFTask.SEQ2SEQ_LM: "AutoModelForSeq2SeqLM",
    HFTask.SEQUENCE_CLASSIFICATION: "AutoModelForSequenceClassification",
}

_PIP_HINT = {
    "timm": "pip install 'batchfit[timm]'",
    "transformers": "pip install 'batchfit[transformers]'",
    "torchvision": "pip install torchvision",
}

_SPEC_FORMS = "use timm:NAME, torchvision:NAME, hf:NAME or path/to/file.py:factory"


# --------------------------------------------------------------------------- entry points

def resolve_model(spec: str, *, model_kwargs: Mapping[str, Any] | None = None,
                  seq_len: int | None = None,
                  input_shape: tuple[int, ...] | None = None, packing: bool = False) -> ModelSpec:
    """Resolve a model string into a :class:`ModelSpec` without building anything for real.

    Args:
        spec: ``timm:NAME``, ``torchvision:NAME``, ``hf:NAME``, ``path/to/file.py:factory``
            or a bare name (tried as timm, torchvision, then the HF table).
        model_kwargs: keyword arguments for the model constructor, the HF config or the
            user factory (see :func:`parse_model_kwargs`).
        seq_len: sequence length of a token model (overrides its default).
        input_shape: per-sample input shape of a non-token model (overrides its default).
        packing: token models: several documents per row, given to the model as
            ``position_ids`` that restart per document (TRL's ``padding_free`` packing).

    Raises:
        ModelSpecError: the spec names no model, or a needed package is missing.
        InvalidInputError: ``seq_len``/``input_shape`` are malformed or do not apply.

    Example:
        >>> import torch
        >>> spec = resolve_model("torchvision:resnet18", model_kwargs={"num_classes": 10})
        >>> spec.input_spec.shape
        (3, 224, 224)
        >>> with torch.device("meta"):
        ...     model = spec.factory()
        >>> model.fc.out_features
        10
    """
    text = str(spec).strip()
    if not text:
        raise ModelSpecError(f"empty model spec: {_SPEC_FORMS}")
    kwargs = dict(model_kwargs or {})
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int)
                                or seq_len <= 0):
        raise InvalidInputError(f"bad sequence length {seq_len!r}: use a positive integer")
    if input_shape is not None:
        input_shape = TensorSpec(tuple(input_shape)).shape  # validates the dimensions
    prefix, _, rest = text.partition(":")
    prefix = prefix.lower()
    from batchfit.models import files

    if files.is_file_spec(text):
        resolved = files.resolve_file(text, kwargs)
    elif prefix == "timm":
        resolved = _resolve_timm(text, rest.strip(), kwargs, input_shape)
    elif prefix == "torchvision":
        resolved = _resolve_torchvision(text, rest.strip(), kwargs)
    elif prefix == "hf":
        resolved = _resolve_hf(text, rest.strip(), kwargs, seq_len)
    else:
        if ":" in text:  # "models/:build": a directory given as the model file
            path, _, factory_name = text.rpartition(":")
            files.check_not_directory(path, factory_name)
        resolved = _resolve_bare(text, kwargs, seq_len, input_shape)
    resolved = _apply_input_overrides(resolved, seq_len, input_shape)
    return _with_packing(resolved) if packing else resolved


def _with_packing(spec: ModelSpec) -> ModelSpec:
    """Add ``position_ids`` (one per token, the sequence's length long) to a token model's
    inputs: the values (where documents restart) set no shape, so any layout traces alike."""
    if not spec.is_token_model or not isinstance(spec.input_spec, Mapping):
        raise InvalidInputError(
            f"{option('packing', True)} applies to Hugging Face token models; '{spec.name}' is "
            "not one")
    tokens = _token_tensor(spec.input_spec)
    positions = TensorSpec(tokens.shape, "int64", low=0, high=tokens.shape[0])
    return replace(spec, input_spec={**spec.input_spec, "position_ids": positions})


def parse_model_kwargs(items: Sequence[str]) -> dict[str, Any]:
    """Parse ``KEY=VALUE`` strings into typed keyword arguments.

    Values become ``bool`` (true/false), ``None`` (none/null), ``int``, ``float``, JSON lists
    and dicts, Python tuples (``(224,224)``) or, failing all that, the plain string.

    Example:
        >>> parse_model_kwargs(["depth=3", "drop_rate=0.1", "pretrained=false", "act=gelu"])
        {'depth': 3, 'drop_rate': 0.1, 'pretrained': False, 'act': 'gelu'}
    """
    parsed: dict[str, Any] = {}
    for item in items:
        key, sep, value = str(item).partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise InvalidInputError(
                f"malformed model argument {item!r}: write KEY=VALUE, like depth=3 or act=gelu")
        if key in parsed:
            raise InvalidInputError(f"model argument {key!r} given twice")
        parsed[key] = _parse_value(value.strip())
    return parsed


def _parse_value(text: str) -> Any:
    lowered = text.lower()
    if lowered in {"true", "false"}:
        return lowered == "true"
    if lowered in {"none", "null"}:
        return None
    for parse in (int, float, json.loads, ast.literal_eval):
        try:
            return parse(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return text


# --------------------------------------------------------------------------- shared helpers

def _import_optional(package: str) -> Any:
    try:
        return importlib.import_module(package)
    except ImportError as exc:
        raise ModelSpecError(f"{package} is not installed: {_PIP_HINT[package]}") from exc


def _has_package(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _suggest(name: str, candidates: Sequence[str], prefix: str = "") -> str:
    """``: did you mean 'x'?`` for the closest candidate, or an empty string."""
    match = difflib.get_close_matches(name.lower(), list(candidates), n=1, cutoff=0.6)
    return f": did you mean '{prefix}{match[0]}'?" if match else ""


def _build_guarded(what: str, build: Callable[..., nn.Module], *args: Any) -> nn.Module:
    """Call ``build(*args)``; turn any failure into a one-line :class:`ModelSpecError`."""
    try:
        return build(*args)
    except BatchfitError:
        raise
    except Exception as exc:
        raise ModelSpecError(f"building {what} failed: {_one_line(exc)}") from exc


def _reject_weights(kwargs: Mapping[str, Any], keys: Sequence[str], library: str) -> None:
    for key in keys:
        if kwargs.get(key) not in (None, False):
            raise ModelSpecError(
                f"{library} argument {key}={kwargs[key]!r} would download weights: batchfit "
                "never loads weights (memory does not depend on their values); drop it")


# --------------------------------------------------------------------------- timm

def _timm_names(timm: Any) -> list[str]:
    return list(timm.list_models())


def _timm_lookup(timm: Any, name: str) -> str | None:
    """The timm name for ``name`` (exact, then lower case), or None."""
    for candidate in (name, name.lower()):
        if timm.is_model(candidate):
            return candidate
    return None


def _resolve_timm(user_spec: str, name: str, kwargs: dict[str, Any],
                  input_shape: tuple[int, ...] | None) -> ModelSpec:
    if name.startswith(("hf-hub:", "hf_hub:", "local-dir:")):
        raise ModelSpecError(
            f"timm name {name!r} reads from the hub or disk: batchfit works offline; use a "
            "built-in architecture name, e.g. timm:vit_base_patch16_224")
    timm = _import_optional("timm")
    found = _timm_lookup(timm, name)
    if found is None:
        raise ModelSpecError(f"unknown timm model {name!r}{_suggest(name, _timm_names(timm))} "
                             "(timm.list_models() lists all)")
    _reject_weights(kwargs, ("pretrained",), "timm")
    kwargs.pop("pretrained", None)
    shape, fixed = _timm_input_size(timm, found, kwargs)
    if fixed and input_shape is not None and input_shape[1:] != shape[1:]:
        built = "x".join(map(str, shape[1:]))
        wanted = input_shape[1:]
        size = wanted[0] if len(set(wanted)) == 1 else list(wanted)
        raise InvalidInputError(
            f"timm model '{found}' is built for {built} inputs: to use "
            f"{'x'.join(map(str, wanted))}, also pass the model argument img_size={size}")
    factory = functools.partial(_build_guarded, f"timm model '{found}'", _build_timm,
                                found, kwargs)
    return ModelSpec(name=user_spec, factory=factory, input_spec=TensorSpec(shape))


def _timm_input_size(timm: Any, name: str,
                     kwargs: Mapping[str, Any]) -> tuple[tuple[int, ...], bool]:
    """Default (C, H, W) of a timm model and whether the model fixes H and W."""
    cfg = timm.models.get_pretrained_cfg(name) or timm.models.get_pretrained_cfg(
        name.split(".")[0])
    channels, height, width = tuple(getattr(cfg, "input_size", None) or (3, 224, 224))
    fixed = bool(getattr(cfg, "fixed_input_size", False))
    if "img_size" in kwargs:
        size = kwargs["img_size"]
        height, width = (size, size) if isinstance(size, int) else tuple(size)
    if "in_chans" in kwargs:
        channels = int(kwargs["in_chans"])
    return (channels, height, width), fixed


def _build_timm(name: str, kwargs: Mapping[str, Any]) -> nn.Module:
    timm = _import_optional("timm")
    return timm.create_model(name, pretrained=False, **kwargs)


# --------------------------------------------------------------------------- torchvision

_TV_VIDEO_FRAMES = 16  # clip length of torchvision's video classification recipe
_TV_SEGMENTATION_SIZE = 520  # resize size of torchvision's segmentation weights


def _tv_kind(models: Any, name: str) -> str:
    for kind in ("segmentation", "detection", "video", "optical_flow"):
        if name in models.list_models(module=getattr(models, kind)):
            return kind
    return "classification"


def _resolve_torchvision(user_spec: str, name: str, kwargs: dict[str, Any]) -> ModelSpec:
    torchvision = _import_optional("torchvision")
    models = torchvision.models
    names = list(models.list_models())
    found = name if name in names else name.lower() if name.lower() in names else None
    if found is None:
        raise ModelSpecError(f"unknown torchvision model {name!r}{_suggest(name, names)} "
                             "(torchvision.models.list_models() lists all)")
    _reject_weights(kwargs, ("weights", "weights_backbone"), "torchvision")
    kwargs.pop("weights", None)
    kind = _tv_kind(models, found)
    if kind in ("detection", "optical_flow"):
        raise ModelSpecError(
            f"torchvision model '{found}' takes a list of images (and targets when training), "
            "which batchfit cannot generate: wrap it in path/to/file.py:factory returning a "
            "module that takes a batched tensor")
    if kind == "segmentation":
        kwargs.setdefault("weights_backbone", None)  # the default would download a backbone
    if found in ("inception_v3", "googlenet", "quantized_inception_v3", "quantized_googlenet"):
        kwargs.setdefault("init_weights", False)  # silences a FutureWarning; init is moot on meta
    shape = _tv_input_shape(models, found, kind, kwargs)
    factory = functools.partial(_build_guarded, f"torchvision model '{found}'",
                                _build_torchvision, found, kwargs)
    return ModelSpec(name=user_spec, factory=factory, input_spec=TensorSpec(shape))


def _tv_input_shape(models: Any, name: str, kind: str,
                    kwargs: Mapping[str, Any]) -> tuple[int, ...]:
    if kind == "segmentation":
        return (3, _TV_SEGMENTATION_SIZE, _TV_SEGMENTATION_SIZE)
    transforms = models.get_model_weights(name).DEFAULT.transforms()
    crop = transforms.crop_size
    height, width = (crop[0], crop[-1]) if isinstance(crop, (list, tuple)) else (crop, crop)
    if name.startswith(("vit_", "maxvit_")):
        # Built without weights, these take image_size (ViT) / input_size (MaxViT), 224 by
        # default, whatever resolution their published weights use.
        size = kwargs.get("image_size", kwargs.get("input_size", 224))
        height, width = (size, size) if isinstance(size, int) else tuple(size)
    if kind == "video":
        return (3, _TV_VIDEO_FRAMES, height, width)
    return (3, height, width)


def _build_torchvision(name: str, kwargs: Mapping[str, Any]) -> nn.Module:
    torchvision = _import_optional("torchvision")
    return torchvision.models.get_model(name, weights=None, **kwargs)


# --------------------------------------------------------------------------- transformers

# Model types whose positions are a learned table: a longer sequence would index past it.
# The value is the table's padding offset (RoBERTa numbers positions from 2).
_LEARNED_POSITIONS = {"gpt2": 0, "bert": 0, "distilbert": 0, "roberta": 2, "xlm-roberta": 2,
                      "camembert": 2, "gpt_neo": 0, "opt": 0}
# Accepted by config constructors for backward compatibility although not attributes.
_LEGACY_CONFIG_KEYS = {"rope_theta", "rope_scaling", "torch_dtype", "dtype"}
# The engine chooses the build dtype from the precision; the checkpoint's dtype is ignored.
_DROPPED_CONFIG_KEYS = ("torch_dtype", "dtype", "_name_or_path", "transformers_version")
_RESERVED_HF_KWARGS = ("task", "attn_implementation")


@dataclass(frozen=True)
class _HFSource:
    """Where a config came from: a raw config dict plus a label for messages."""

    label: str
    config: Mapping[str, Any]


def _hf_source(name: str) -> _HFSource | None:
    """The config of ``hf:NAME``: a local directory's, the local Hugging Face cache's, the
    offline table's, or the hub's (:mod:`batchfit.models.hub`), in that order; None when
    none has it and the hub is not asked (offline, or not a hub id)."""
    path = Path(name).expanduser()
    if path.is_dir():
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ModelSpecError(
                f"directory '{name}' has no config.json: put the model's config.json there")
        try:
            config = json.loads(config_file.read_text())
        except (OSError, ValueError) as exc:
            raise ModelSpecError(f"cannot read '{config_file}': {_one_line(exc)}") from exc
        if not isinstance(config, dict) or "model_type" not in config:
            raise ModelSpecError(f"'{config_file}' has no \"model_type\": is it a transformers "
                                 "config.json?")
        return _HFSource(f"'{name}'", config)
    on_hub = hub.is_hub_id(name)
    cached = hub.cached_config(name) if on_hub else None
    if cached is not None:
        return _HFSource(f"'{name}'", cached)
    entry = find_hf_config(name)
    if entry is not None:
        return _HFSource(f"'{entry.hub_name}'", dict(entry.config))
    if on_hub and not hub.offline():
        return _HFSource(f"'{name}'", hub.download_config(name))
    return None


def _hf_suggestion(name: str) -> str:
    """``: did you mean 'hf:ORG/NAME'?`` for a table model that ``name`` looks like a typo
    of, or an empty string.

    A Hub id is compared whole (the organisation too) with the table's Hub ids, closely
    (ratio 0.8), and only with ids that name the same sizes ("1.5b", "7b"): a model of
    another size or another organisation is another model, not a spelling of this one."""
    lowered = name.lower()
    candidates = [n for n in hf_config_names() if ("/" in n) == ("/" in lowered)]
    sizes = set(_SIZE.findall(lowered))
    candidates = [n for n in candidates if set(_SIZE.findall(n)) == sizes]
    match = difflib.get_close_matches(lowered, candidates, n=1, cutoff=0.8)
    if not match:
        return ""
    entry = find_hf_config(match[0])
    return f": did you mean 'hf:{entry.hub_name if '/' in match[0] else match[0]}'?"


#: A model size in its name: "7b", "1.5b", "350m" (not "v0.1" or "3.1").
_SIZE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?[bm])(?![\w.])")


def _unknown_hf_error(name: str) -> ModelSpecError:
    suggestion = _hf_suggestion(name)
    where = (f"; {hub.offline_hint(name)}" if hub.is_hub_id(name) else
             " (built-in configs: batchfit.models.hf_configs; for another model, put its "
             "config.json in a local directory and pass hf:path/to/dir)")
    return ModelSpecError(f"unknown hf model {name!r}{suggestion}{where}")


def _resolve_hf(user_spec: str, name: str, kwargs: dict[str, Any],
                seq_len: int | None) -> ModelSpec:
    source = _hf_source(name)
    if source is None:
        raise _unknown_hf_error(name)
    return _hf_spec(user_spec, source, kwargs, seq_len)


def load_hf_config(name: str, model_kwargs: Mapping[str, Any] | None = None) -> Any:
    """The transformers config of ``hf:NAME`` (offline table or local directory), with
    ``model_kwargs`` overrides, without building the model.

    Example:
        >>> load_hf_config("Meta-Llama-3-8B").num_key_value_heads
        8
    """
    name = str(name).strip().removeprefix("hf:")
    source = _hf_source(name)
    if source is None:
        raise _unknown_hf_error(name)
    kwargs = dict(model_kwargs or {})
    for key in _RESERVED_HF_KWARGS:
        kwargs.pop(key, None)
    return _hf_config(_import_optional("transformers"), source, kwargs)


def checkpoint_dtype(name: str) -> str | None:
    """The dtype ``hf:NAME``'s checkpoint is stored in (its config's ``torch_dtype``), which a
    serving engine loads it in; None when the config does not say."""
    source = _hf_source(str(name).strip().removeprefix("hf:"))
    if source is None:
        raise _unknown_hf_error(name)
    return _stored_dtype(source)


def _stored_dtype(source: _HFSource) -> str | None:
    value = source.config.get("torch_dtype") or source.config.get("dtype")
    return str(value).removeprefix("torch.") if value else None


def _hf_spec(user_spec: str, source: _HFSource, kwargs: dict[str, Any],
             seq_len: int | None) -> ModelSpec:
    transformers = _import_optional("transformers")
    task_arg = kwargs.pop("task", None)
    attn = kwargs.pop("attn_implementation", "sdpa")
    config = _hf_config(transformers, source, kwargs)
    task = (parse_enum(HFTask, task_arg, "hf task") if task_arg is not None
            else _hf_default_task(transformers, config))
    if task is HFTask.SEQUENCE_CLASSIFICATION and getattr(config, "pad_token_id", None) is None:
        # Decoder classifiers pool the last non-pad token and refuse batches without a pad id.
        config.pad_token_id = 0
    vocab_size = int(config.vocab_size)
    default_len = _hf_default_seq_len(config, task)
    _check_positions(config, source, seq_len or default_len)
    what = f"hf model {source.label} ({_AUTO_CLASS[task]})"
    factory = functools.partial(_build_guarded, what, _build_hf, config, task, attn)
    return ModelSpec(name=user_spec, factory=factory,
                     input_spec=_hf_input_spec(config, task, vocab_size, default_len),
                     is_token_model=True, vocab_size=vocab_size, default_seq_len=default_len,
                     hf_labels=True, max_positions=_max_positions(config), hf_task=task,
                     hf_task_chosen=task_arg is None, checkpoint_dtype=_stored_dtype(source))


def _hf_config(transformers: Any, source: _HFSource, overrides: Mapping[str, Any]) -> Any:
    """Build the config from the raw dict with ``overrides`` merged in before construction
    (derived fields such as ``head_dim`` are computed in the constructor)."""
    raw = {k: v for k, v in source.config.items() if k not in _DROPPED_CONFIG_KEYS}
    model_type = raw.pop("model_type")
    try:
        config_class = transformers.models.auto.configuration_auto.CONFIG_MAPPING[model_type]
    except KeyError as exc:
        raise ModelSpecError(
            f"transformers {transformers.__version__} does not know model_type "
            f"{model_type!r} of {source.label}: upgrade transformers, or build a model with "
            "custom code in path/to/file.py:factory") from exc
    known = _config_keys(config_class, raw)
    for key in overrides:
        if key not in known:
            raise ModelSpecError(
                f"unknown config field {key!r} for {source.label} ({config_class.__name__})"
                f"{_suggest(key, sorted(known))}")
    if "use_cache" in known:
        # A training step keeps no KV cache; an inference trace can ask with use_cache=true.
        raw["use_cache"] = False
    try:
        return config_class(**{**raw, **overrides})
    except Exception as exc:
        raise ModelSpecError(f"bad config for {source.label}: {_one_line(exc)}") from exc


def _config_keys(config_class: type, raw: Mapping[str, Any]) -> set[str]:
    """Every field name ``config_class`` understands.

    Config classes swallow unknown keyword arguments silently, so overrides are checked
    against a default instance, the constructor signature and the published fields.
    """
    default = config_class()
    known = set(raw) | set(default.to_dict()) | _LEGACY_CONFIG_KEYS
    known |= set(inspect.signature(config_class.__init__).parameters) - {"self", "kwargs"}
    known |= set(getattr(config_class, "attribute_map", {}))
    known |= {key for key in dir(default) if not key.startswith("_")
              and not callable(getattr(type(default), key, None))}
    return known


def _hf_default_task(transformers: Any, config: Any) -> HFTask:
    for arch in getattr(config, "architectures", None) or ():
        if arch.endswith(("ForCausalLM", "LMHeadModel")):
            return HFTask.CAUSAL_LM
        if arch.endswith("ForMaskedLM"):
            return HFTask.MASKED_LM
        if arch.endswith("ForConditionalGeneration") and config.is_encoder_decoder:
            return HFTask.SEQ2SEQ_LM
    auto = transformers.models.auto.modeling_auto
    seq2seq = auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES
    if config.is_encoder_decoder and config.model_type in seq2seq:
        return HFTask.SEQ2SEQ_LM
    if config.model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return HFTask.MASKED_LM
    if config.model_type in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return HFTask.CAUSAL_LM
    raise ModelSpecError(
        f"cannot tell which head to build for model_type {config.model_type!r}: pass the "
        "model argument task=causal-lm, masked-lm, seq2seq-lm or sequence-classification")


def _max_positions(config: Any) -> int | None:
    value = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return int(value) if value else None


def _hf_default_seq_len(config: Any, task: HFTask) -> int:
    positions = _max_positions(config)
    if positions is not None:
        positions -= _LEARNED_POSITIONS.get(config.model_type, 0)
    cap = 4096 if task is HFTask.CAUSAL_LM else 512
    return min(positions, cap) if positions else cap


def _check_positions(config: Any, source: _HFSource, seq_len: int) -> None:
    if config.model_type not in _LEARNED_POSITIONS:
        return  # rotary / relative positions: no hard limit in the module
    limit = (_max_positions(config) or seq_len) - _LEARNED_POSITIONS[config.model_type]
    if seq_len > limit:
        field = "n_positions" if config.model_type == "gpt2" else "max_position_embeddings"
        raise InvalidInputError(
            f"sequence length {seq_len} exceeds the {limit} positions of {source.label}: use "
            f"{option('seq_len', limit)} or less, or pass the model argument {field}=N")


def _hf_input_spec(config: Any, task: HFTask, vocab_size: int,
                   seq_len: int) -> dict[str, TensorSpec]:
    tokens = TensorSpec((seq_len,), "int64", low=0, high=vocab_size)
    if task is HFTask.SEQUENCE_CLASSIFICATION:
        num_labels = max(int(getattr(config, "num_labels", 2)), 2)
        return {"input_ids": tokens, "labels": TensorSpec((), "int64", low=0, high=num_labels)}
    return {"input_ids": tokens, "labels": tokens}


def _build_hf(config: Any, task: HFTask, attn: str | None) -> nn.Module:
    import torch
    transformers = _import_optional("transformers")
    auto = getattr(transformers, _AUTO_CLASS[task])
    major = int(transformers.__version__.split(".")[0])
    # from_config builds in config.dtype (transformers 5) unless told: follow the default
    # dtype, which the engine sets for low-precision builds.
    dtype_kwarg = {"dtype" if major >= 5 else "torch_dtype": torch.get_default_dtype()}
    config = copy.deepcopy(config)  # from_config writes the dtype back into the config
    try:
        return auto.from_config(config, attn_implementation=attn, **dtype_kwarg)
    except ValueError as exc:
        text = str(exc).lower()
        if attn != "sdpa" or ("sdpa" not in text and "scaled_dot_product" not in text):
            raise
    return auto.from_config(config, attn_implementation="eager", **dtype_kwarg)


# --------------------------------------------------------------------------- bare names

def _resolve_bare(text: str, kwargs: dict[str, Any], seq_len: int | None,
                  input_shape: tuple[int, ...] | None) -> ModelSpec:
    suggestions: list[str] = []
    if _has_package("timm"):
        timm = _import_optional("timm")
        if _timm_lookup(timm, text):
            return _resolve_timm(text, text, kwargs, input_shape)
        suggestions += [f"timm:{n}" for n in _timm_names(timm)]
    if _has_package("torchvision"):
        names = list(_import_optional("torchvision").models.list_models())
        if text in names or text.lower() in names:
            return _resolve_torchvision(text, text, kwargs)
        suggestions += [f"torchvision:{n}" for n in names]
    source = _hf_source(text) if find_hf_config(text) or os.path.isdir(text) else None
    if source is not None:
        return _hf_spec(text, source, kwargs, seq_len)
    suggestions += [f"hf:{n}" for n in hf_config_names()]
    match = difflib.get_close_matches(text.lower(), [s.split(":", 1)[1] for s in suggestions],
                                      n=1, cutoff=0.6)
    hint = ""
    if match:
        full = next(s for s in suggestions if s.split(":", 1)[1] == match[0])
        hint = f" (did you mean '{full}'?)"
    raise ModelSpecError(f"unknown model spec {text!r}{hint}: {_SPEC_FORMS}")


# --------------------------------------------------------------------------- input overrides

def _apply_input_overrides(spec: ModelSpec, seq_len: int | None,
                           input_shape: tuple[int, ...] | None) -> ModelSpec:
    if seq_len is not None:
        if not spec.is_token_model:
            raise InvalidInputError(
                f"{option('seq_len')} applies to token models; '{spec.name}' takes no token "
                f"ids: set its input shape with {option('input_shape')}")
        spec = replace(spec, input_spec=_with_seq_len(spec.input_spec, spec.default_seq_len,
                                                      seq_len))
    if input_shape is not None:
        if spec.is_token_model:
            raise InvalidInputError(
                f"'{spec.name}' takes token ids: set the sequence length with "
                f"{option('seq_len')}, not {option('input_shape')}")
        spec = replace(spec, input_spec=_with_shape(spec, input_shape))
    return spec


def _with_seq_len(input_spec: InputSpec | None, old: int | None, new: int) -> InputSpec | None:
    """Set the sequence axis of every batched tensor whose first dimension is ``old``."""
    def update(tensor: TensorSpec) -> TensorSpec:
        if tensor.batched and tensor.shape and tensor.shape[0] == old:
            return tensor.with_seq_len(new)
        return tensor
    if input_spec is None:
        return None
    if isinstance(input_spec, TensorSpec):
        return update(input_spec)
    if isinstance(input_spec, Mapping):
        return {key: update(value) for key, value in input_spec.items()}
    return tuple(update(value) for value in input_spec)


def _with_shape(spec: ModelSpec, shape: tuple[int, ...]) -> TensorSpec:
    if spec.input_spec is None:
        return TensorSpec(shape)
    if isinstance(spec.input_spec, TensorSpec):
        return replace(spec.input_spec, shape=shape)
    raise InvalidInputError(
        f"'{spec.name}' takes several input tensors: {option('input_shape')} sets a single "
        "tensor; describe "
        "the inputs in a factory file (path/to/file.py:factory returning an input_spec)")
