"""Fine-tuning recipes: what each LLM framework does by default, as one switch.

A recipe fills in the :class:`~batchfit.engine.spec.TrainConfig` fields the user left unset
(None); an explicit value always wins. Each preset follows the framework's source at the
commit named in ``docs/guides/llm-recipes.md``; the file and behaviour are cited per field.

* ``peft``: plain transformers + peft, the QLoRA notebook recipe. peft's
  ``prepare_model_for_kbit_training`` (peft/utils/other.py) upcasts every remaining
  fp16/bf16 parameter (embeddings, norms, head) to fp32 and turns on gradient checkpointing
  (``use_gradient_checkpointing=True``); ``get_peft_model(autocast_adapter_dtype=True)``
  keeps adapters in fp32; compute in bf16 autocast; transformers' float32 loss. Its
  ``gradient_checkpointing_kwargs=None`` becomes ``{}``, which it passes on to
  ``gradient_checkpointing_enable``; transformers replaces only None with its own default,
  so ``functools.partial(checkpoint, **{})`` leaves ``use_reentrant`` to torch, whose
  ``checkpoint`` takes None as True (torch/utils/checkpoint.py): reentrant checkpointing.
* ``litgpt``: ``litgpt finetune_lora --precision bf16-true --quantize bnb.nf4``
  (litgpt/finetune/lora.py): mixed precision with quantization is refused ("Quantization and
  mixed precision is not supported"); ``BitsandbytesPrecision(quantize[4:], dtype)`` quantizes
  without any kbit preparation, and the model, adapters included, is created in bf16
  (``lora_A = nn.Parameter(torch.empty(...))`` in litgpt/lora.py, under Fabric's bf16 init
  context); no activation checkpointing; the loss is ``chunked_cross_entropy``
  (litgpt/utils.py), 128 tokens at a time, with no upcast of its own (Fabric hands it
  float32 logits, and litgpt's model differs from transformers' in more ways:
  :mod:`batchfit.engine.workloads.litgpt`); with
  quantization the optimizer is ``bnb.optim.PagedAdamW`` (``instantiate_bnb_optimizer`` in
  litgpt/utils.py), AdamW otherwise. Its loop assigns ``logits = model(...)`` and
  ``loss = chunked_cross_entropy(...)`` each iteration, so the last step's outputs, and the
  autograd graph behind them, live until the next step's forward replaces them
  (``holds_loss``; batchfit replaces them after the next loss, a few MB later).
* ``torchtune``: ``tune run lora_finetune_single_device --config llama2/7B_qlora_single_device``
  (recipes/configs/llama2/7B_qlora_single_device.yaml): ``dtype: bf16`` for the whole model,
  adapters included (``self.lora_a = nn.Linear(...)`` in torchtune/modules/peft/lora.py,
  built under the recipe's default dtype); NF4 base weights from torchao without kbit
  preparation; ``enable_activation_checkpointing: True``; ``torch.optim.AdamW`` with
  ``fused: True``; the chunked output cross-entropy (torchtune/modules/loss/
  ce_chunked_output_loss.py: 8 chunks, each upcast to float32 on its own);
  ``compile: False`` (torch.compile is not modelled, see :data:`COMPILE_NOTE`);
  ``checkpoint_wrapper(..., checkpoint_impl=CheckpointImpl.NO_REENTRANT)``
  (torchtune/training/activations.py): non-reentrant checkpointing.
* ``unsloth``: ``FastLanguageModel.from_pretrained(load_in_4bit=True)`` and its notebooks:
  bf16 weights and adapters, no peft kbit upcast, ``use_gradient_checkpointing="unsloth"``
  (modelled as plain checkpointing: its CPU offload of the saved hidden states is not), the
  fused cross-entropy that never makes float32 logits (modelled as the loss on the bf16
  logits), ``optim="adamw_8bit"``; its checkpointing is reentrant (``use_reentrant = True``
  in unsloth/models/llama.py and ``prepare_model_for_kbit_training`` in
  unsloth/models/_utils.py).
* ``axolotl``: a peft-based trainer. ``ModelLoader._prepare_model_for_quantization``
  (src/axolotl/loaders/model.py) runs ``prepare_model_for_kbit_training`` for QLoRA except
  for Qwen, LoftQ, FSDP and DeepSpeed ZeRO-3; its QLoRA examples
  (examples/llama-2/qlora.yml, examples/llama-3/qlora.yml) set ``bf16: auto``,
  ``gradient_checkpointing: true`` and ``optimizer: paged_adamw_32bit``; ``normalize_config``
  (src/axolotl/utils/config/__init__.py) sets ``gradient_checkpointing_kwargs =
  {"use_reentrant": True}`` when the config gives none: reentrant checkpointing.

Without a recipe's own choice, Hugging Face checkpointing is as transformers sets it when
``gradient_checkpointing_kwargs`` is None (``gradient_checkpointing_enable`` in
modeling_utils.py): ``{"use_reentrant": True}`` before 5.0 (4.35-4.57; earlier releases
called ``checkpoint`` without it, torch's True), ``{"use_reentrant": False}`` from 5.0
(huggingface/transformers#43203): :func:`default_reentrant`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from batchfit.errors import InvalidInputError

#: What batchfit says about ``torch.compile`` wherever a recipe that offers it is chosen.
COMPILE_NOTE = ("torch.compile is not modelled: the step is traced eagerly (inductor's fusion "
                "of the loss and elementwise chains usually lowers the peak, so the estimate "
                "is an upper bound for a compiled run)")


class Recipe(StrEnum):
    """A fine-tuning framework whose defaults a step follows."""

    PEFT = "peft"
    LITGPT = "litgpt"
    TORCHTUNE = "torchtune"
    UNSLOTH = "unsloth"
    AXOLOTL = "axolotl"


@dataclass(frozen=True)
class RecipeDefaults:
    """What a framework does when the user does not say otherwise.

    Fields ending in ``_quant`` apply with quantized base weights (QLoRA), the others to
    every LoRA step. ``precision`` names a :class:`~batchfit.engine.spec.Precision`.
    """

    recipe: Recipe
    kbit_prepare: bool
    adapter_dtype: str
    precision: str
    precision_quant: str
    checkpointing: bool
    checkpointing_quant: bool
    loss: str
    optimizer: str
    optimizer_quant: str
    compile_note: str | None = None
    holds_loss: bool = False
    #: the framework's ``use_reentrant`` for activation checkpointing; None: transformers'
    use_reentrant: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"recipe": self.recipe.value, "kbit_prepare": self.kbit_prepare,
                "adapter_dtype": self.adapter_dtype, "precision": self.precision,
                "precision_quant": self.precision_quant, "checkpointing": self.checkpointing,
                "checkpointing_quant": self.checkpointing_quant, "loss": self.loss,
                "optimizer": self.optimizer, "optimizer_quant": self.optimizer_quant,
                "compile_note": self.compile_note, "holds_loss": self.holds_loss,
                "use_reentrant": self.use_reentrant}


RECIPES: dict[Recipe, RecipeDefaults] = {
    Recipe.PEFT: RecipeDefaults(
        Recipe.PEFT, kbit_prepare=True, adapter_dtype="fp32", precision="fp32",
        precision_quant="amp-bf16", checkpointing=False, checkpointing_quant=True,
        loss="standard", optimizer="adamw", optimizer_quant="adamw"),
    Recipe.LITGPT: RecipeDefaults(
        Recipe.LITGPT, kbit_prepare=False, adapter_dtype="bf16", precision="bf16",
        precision_quant="bf16", checkpointing=False, checkpointing_quant=False,
        loss="native", optimizer="adamw", optimizer_quant="paged-adamw32bit",
        holds_loss=True),
    Recipe.TORCHTUNE: RecipeDefaults(
        Recipe.TORCHTUNE, kbit_prepare=False, adapter_dtype="bf16", precision="bf16",
        precision_quant="bf16", checkpointing=True, checkpointing_quant=True,
        loss="chunked-output", optimizer="adamw", optimizer_quant="adamw",
        compile_note=COMPILE_NOTE, use_reentrant=False),
    Recipe.UNSLOTH: RecipeDefaults(
        Recipe.UNSLOTH, kbit_prepare=False, adapter_dtype="bf16", precision="bf16",
        precision_quant="bf16", checkpointing=True, checkpointing_quant=True,
        loss="native", optimizer="adamw8bit", optimizer_quant="adamw8bit",
        use_reentrant=True),
    Recipe.AXOLOTL: RecipeDefaults(
        Recipe.AXOLOTL, kbit_prepare=True, adapter_dtype="fp32", precision="amp-bf16",
        precision_quant="amp-bf16", checkpointing=True, checkpointing_quant=True,
        loss="standard", optimizer="paged-adamw32bit", optimizer_quant="paged-adamw32bit",
        use_reentrant=True),
}

#: torchtune's optimizer configs pass ``fused: True`` (recipes/configs/*/*lora*.yaml).
FUSED_OPTIMIZER = {Recipe.TORCHTUNE}


def parse_recipe(value: Recipe | str | None) -> Recipe | None:
    """``"litgpt"`` -> :attr:`Recipe.LITGPT`; None stays None; anything else is refused."""
    if value is None or isinstance(value, Recipe):
        return value
    try:
        return Recipe(str(value).strip().lower())
    except ValueError:
        raise InvalidInputError(f"unknown recipe {value!r}: choose one of "
                                f"{', '.join(r.value for r in Recipe)}") from None


def recipe_defaults(recipe: Recipe | None, quantized: bool) -> RecipeDefaults | None:
    """The defaults of ``recipe``; with no recipe, peft's for a quantized step (QLoRA as
    transformers and peft run it), none otherwise."""
    if recipe is None:
        return RECIPES[Recipe.PEFT] if quantized else None
    return RECIPES[recipe]


#: The first transformers release whose ``gradient_checkpointing_enable`` defaults to
#: ``use_reentrant=False`` (huggingface/transformers#43203; 4.57 still sets True).
NON_REENTRANT_DEFAULT = (5, 0)


def default_reentrant(recipe: Recipe | None, kbit_prepare: bool,
                      transformers_version: tuple[int, int] | None) -> tuple[bool, str]:
    """Whether Hugging Face activation checkpointing is reentrant when the user does not
    say, and why (see the module docstring): the recipe's own choice; else, when peft's
    ``prepare_model_for_kbit_training`` turns checkpointing on, torch's default (True);
    else transformers' default for ``transformers_version`` (None: the installed one)."""
    own = RECIPES[recipe].use_reentrant if recipe is not None else None
    if own is not None:
        return own, f"{recipe.value}'s checkpointing"
    if kbit_prepare:
        return True, ("peft's prepare_model_for_kbit_training leaves use_reentrant to "
                      "torch's checkpoint, which defaults to True")
    if transformers_version is None:
        from importlib.metadata import PackageNotFoundError

        from batchfit.engine.workloads.hfloss import installed_version

        try:
            transformers_version = installed_version()
        except PackageNotFoundError:  # no Hugging Face model to checkpoint
            return False, "torch's recommended variant (transformers is not installed)"
    version = ".".join(map(str, transformers_version))
    return transformers_version < NON_REENTRANT_DEFAULT, f"transformers {version}'s default"


def check_recipe(recipe: Recipe, *, lora: Any, quant: Any, precision: Any,
                 training: bool) -> None:
    """Refuse a recipe the framework cannot run with the other choices, saying why."""
    name = recipe.value
    if training and lora is None:
        raise InvalidInputError(f"--recipe {name} is a LoRA/QLoRA fine-tuning recipe: add "
                                "--lora (e.g. r=8,alpha=16) or drop --recipe")
    mixed = str(getattr(precision, "value", precision)).startswith("amp-")
    if recipe is Recipe.LITGPT and quant is not None and mixed:
        raise InvalidInputError(
            f"--recipe litgpt with --quant refuses --precision {precision.value}: litgpt "
            "raises 'Quantization and mixed precision is not supported' (use bf16 or fp16)")
    if recipe is Recipe.TORCHTUNE and quant is not None and quant.method.value != "nf4-dq" \
            and quant.method.value != "nf4":
        raise InvalidInputError(
            f"--recipe torchtune quantizes with torchao's NF4 only, not "
            f"{quant.method.value}: use --quant nf4 or another recipe")
