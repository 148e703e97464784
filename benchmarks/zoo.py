"""The benchmark zoo: models, batch sizes and settings batchfit is checked on, in the words a
user asks with.

How it asks batchfit: it does not: it lists the cases accuracy_cpu.py runs, each as a model
spec string (``timm:NAME``, ``hf:NAME`` or ``benchmarks/zoo.py:FACTORY``) and the options'
names as keywords, ``batchfit.estimate(case.spec, case.batch_size, device="cpu",
**case.words)``.

Every case is small enough to run for real on a 2-core CPU in under ~20 s per
step, and together they cover: convolutional nets (with BatchNorm, depthwise
convolutions, dense connections), vision transformers, decoder-only, encoder-only
and encoder-decoder language models, a recurrent net and a U-Net; SGD with
momentum and AdamW; fp32, amp-bf16 (CPU autocast) and pure bf16; activation
checkpointing; inference.

The real step of a case (:meth:`Case.step`) is the one its words name, resolved as batchfit
resolves them, so the measured step and the question cannot drift apart. The factories
below are model files' factories (``benchmarks/zoo.py:unet_autoencoder``); timm and
transformers models are named by their spec strings. Paths in spec strings are relative to
the repository root.

Usage: ``from zoo import CASES`` (with ``benchmarks/`` on ``sys.path``), or
``python benchmarks/zoo.py`` to list the cases.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from batchfit.engine.spec import InputSpec, TensorSpec, TrainConfig

ROOT = Path(__file__).resolve().parent.parent
ZOO = "benchmarks/zoo.py"
#: a 4-layer Llama of width 256 (Llama-2's vocabulary and layout)
LLAMA_TINY = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 4}


@dataclass(frozen=True)
class Case:
    """One benchmark case: ``batchfit.estimate(spec, batch_size, device="cpu", **words)``.

    ``factory``, ``inputs`` and ``config`` are the step those words name (what the real run
    builds and what the engine's diagnostics trace), resolved by batchfit's own resolver.
    """

    name: str
    spec: str
    batch_size: int
    words: Mapping[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        w = self.words
        if w.get("mode") == "infer":
            what = f"infer {w.get('precision', 'fp32')}"
        else:
            what = (f"train {w.get('optimizer', 'adamw')} {w.get('precision', 'fp32')}"
                    + (" ckpt" if w.get("checkpointing") else ""))
        return f"B={self.batch_size} {what}"

    @cached_property
    def step(self) -> Any:
        """The step the words name (a :class:`batchfit.api.step.Step`), as
        ``batchfit.estimate`` resolves it; a model file is found from the repository root."""
        from batchfit.api.step import resolve_step, stack_settings

        spec = str(ROOT / self.spec) if self.spec.startswith(f"{ZOO}:") else self.spec
        return resolve_step(spec, **self.words, **stack_settings())

    @property
    def factory(self) -> Any:
        return self.step.spec.factory

    @property
    def inputs(self) -> InputSpec:
        return self.step.inputs

    @property
    def config(self) -> TrainConfig:
        return self.step.config


# -- model files' factories -------------------------------------------------------------


def gpt2_forward(n_layer: int = 4, seq_len: int = 128) -> tuple[nn.Module, dict[str, TensorSpec]]:
    """A model file's factory: GPT-2 of transformers' default config with ``n_layer`` layers,
    fed token ids alone (an inference forward that computes no loss; an ``hf:`` spec's batch
    carries labels, so its forward computes the loss too)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=n_layer))
    return model, {"input_ids": TensorSpec((seq_len,), "int64", high=model.config.vocab_size)}


def llama_tiny_forward(seq_len: int = 128) -> tuple[nn.Module, dict[str, TensorSpec]]:
    """A model file's factory: a 4-layer Llama of width 256 (Llama-2's vocabulary) fed token
    ids alone, as :func:`gpt2_forward`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**LLAMA_TINY, vocab_size=32000))
    return model, {"input_ids": TensorSpec((seq_len,), "int64", high=32000)}


class LSTMClassifier(nn.Module):
    """A 2-layer LSTM over ``(seq, features)`` with a linear head on the last step."""

    def __init__(self, features: int = 128, hidden: int = 256, layers: int = 2,
                 classes: int = 10):
        super().__init__()
        self.lstm = nn.LSTM(features, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def _conv_block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class UNet(nn.Module):
    """A 3-level U-Net: encoder, bottleneck, decoder with skip connections (concat)."""

    def __init__(self, channels: int = 1, width: int = 32):
        super().__init__()
        w = width
        self.enc1, self.enc2, self.enc3 = _conv_block(channels, w), _conv_block(w, 2 * w), \
            _conv_block(2 * w, 4 * w)
        self.bottleneck = _conv_block(4 * w, 8 * w)
        self.up3 = nn.ConvTranspose2d(8 * w, 4 * w, 2, stride=2)
        self.dec3 = _conv_block(8 * w, 4 * w)
        self.up2 = nn.ConvTranspose2d(4 * w, 2 * w, 2, stride=2)
        self.dec2 = _conv_block(4 * w, 2 * w)
        self.up1 = nn.ConvTranspose2d(2 * w, w, 2, stride=2)
        self.dec1 = _conv_block(2 * w, w)
        self.out = nn.Conv2d(w, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        e3 = self.enc3(F.max_pool2d(e2, 2))
        b = self.bottleneck(F.max_pool2d(e3, 2))
        d3 = self.dec3(torch.cat([self.up3(b), e3], dim=1))
        d2 = self.dec2(torch.cat([self.up2(d3), e2], dim=1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], dim=1))
        return self.out(d1)


def reconstruction_loss(output: torch.Tensor, batch: tuple[tuple, dict]) -> torch.Tensor:
    """MSE between the U-Net's output and its input (an autoencoding objective)."""
    (image,), _ = batch
    return F.mse_loss(output.float(), image.float())


def unet_autoencoder(channels: int = 1, size: int = 128) -> tuple[nn.Module, TensorSpec, Any]:
    """A model file's factory: the U-Net, its per-sample image and its reconstruction loss
    (a loss no option names, so the file returns it, as a user's file would)."""
    return UNet(channels), TensorSpec((channels, size, size)), reconstruction_loss


# -- the cases ---------------------------------------------------------------------------


def _gpt2(**words: Any) -> dict[str, Any]:
    return {"model_kwargs": {"n_layer": 4}, "seq_len": 128, **words}


def _bert(**words: Any) -> dict[str, Any]:
    return {"model_kwargs": {"num_hidden_layers": 4}, "seq_len": 128, **words}


LLAMA = "hf:meta-llama/Llama-2-7b-hf"

CASES: tuple[Case, ...] = (
    # vision, convolutional (timm's default input: 3x224x224)
    Case("resnet50", "timm:resnet50", 8, {"optimizer": "adamw"}),
    Case("resnet50-infer", "timm:resnet50", 16, {"mode": "infer", "precision": "fp32"}),
    Case("mobilenetv3-bf16", "timm:mobilenetv3_large_100", 16,
         {"optimizer": "momentum", "precision": "amp-bf16"}),
    Case("efficientnet_b0-ckpt", "timm:efficientnet_b0", 8,
         {"optimizer": "adamw", "checkpointing": True}),
    Case("convnext_tiny-bf16", "timm:convnext_tiny", 4,
         {"optimizer": "adamw", "precision": "amp-bf16"}),
    Case("densenet121", "timm:densenet121", 4, {"optimizer": "momentum"}),
    Case("densenet121-ckpt", "timm:densenet121", 4,
         {"optimizer": "momentum", "checkpointing": True}),
    # vision transformer
    Case("vit_small", "timm:vit_small_patch16_224", 8, {"optimizer": "adamw"}),
    Case("vit_small-bf16-ckpt", "timm:vit_small_patch16_224", 8,
         {"optimizer": "adamw", "precision": "amp-bf16", "checkpointing": True}),
    # language models (Hugging Face computes the loss from labels)
    Case("gpt2-4l", "hf:gpt2", 4, _gpt2(optimizer="adamw")),
    Case("gpt2-4l-bf16-ckpt", "hf:gpt2", 4,
         _gpt2(optimizer="adamw", precision="amp-bf16", checkpointing=True)),
    Case("gpt2-4l-infer", f"{ZOO}:gpt2_forward", 8, {"mode": "infer", "precision": "fp32"}),
    Case("bert-base-4l", "hf:bert-base-uncased", 4, _bert(optimizer="momentum")),
    # no vocabulary-sized logits: the peak is the encoder's activations
    Case("bert-base-4l-cls", "hf:bert-base-uncased", 16,
         {"model_kwargs": {"num_hidden_layers": 4, "task": "sequence-classification"},
          "seq_len": 256, "optimizer": "adamw"}),
    Case("t5-small", "hf:t5-small", 4, {"seq_len": 128, "optimizer": "adamw"}),
    Case("llama-tiny-bf16", LLAMA, 4, {"model_kwargs": LLAMA_TINY, "seq_len": 128,
                                       "optimizer": "adamw", "precision": "amp-bf16"}),
    Case("llama-tiny-infer", f"{ZOO}:llama_tiny_forward", 8,
         {"mode": "infer", "precision": "fp32"}),
    # recurrent and dense prediction
    Case("lstm", f"{ZOO}:LSTMClassifier", 32, {"input_shape": "64x128", "optimizer": "adamw"}),
    Case("unet", f"{ZOO}:unet_autoencoder", 8, {"optimizer": "adamw"}),
    Case("unet-rgb-pure-bf16", f"{ZOO}:unet_autoencoder", 4,
         {"model_kwargs": {"channels": 3}, "optimizer": "momentum", "precision": "bf16"}),
)

BY_NAME: dict[str, Case] = {case.name: case for case in CASES}


if __name__ == "__main__":
    for case in CASES:
        print(f"{case.name:24s} {case.spec:36s} {case.describe()}")
