"""The benchmark zoo: models, inputs, batch sizes and configs batchfit is checked on.

How it asks batchfit: it does not: it lists the cases accuracy_cpu.py and the tests run.

Every case is small enough to run for real on a 2-core CPU in under ~20 s per
step, and together they cover: convolutional nets (with BatchNorm, depthwise
convolutions, dense connections), vision transformers, decoder-only, encoder-only
and encoder-decoder language models, a recurrent net and a U-Net; SGD with
momentum and AdamW; fp32, amp-bf16 (CPU autocast) and pure bf16; activation
checkpointing; inference.

Factories are zero-argument callables: the engine calls them under
``torch.device("meta")``, the measurement for real. timm and transformers are
imported inside them, so importing this file is cheap.

Usage: ``from zoo import CASES`` (with ``benchmarks/`` on ``sys.path``), or
``python benchmarks/zoo.py`` to list the cases.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from batchfit.engine.spec import InputSpec, TensorSpec, TrainConfig


@dataclass(frozen=True)
class Case:
    """One benchmark case: ``batchfit.estimate(factory, inputs, batch_size, config)``."""

    name: str
    factory: Callable[[], nn.Module]
    inputs: InputSpec
    batch_size: int
    config: TrainConfig

    def describe(self) -> str:
        c = self.config
        if c.mode.value == "infer":
            what = f"infer {c.precision.value}"
        else:
            optimizer = c.optimizer if isinstance(c.optimizer, str) else c.optimizer.value
            what = f"train {optimizer} {c.precision.value}" + (" ckpt" if c.checkpointing else "")
        return f"B={self.batch_size} {what}"


# -- factories ---------------------------------------------------------------------------


def timm_model(name: str, **kwargs: Any) -> nn.Module:
    import timm

    return timm.create_model(name, **kwargs)


def gpt2(n_layer: int = 4, n_embd: int = 768, n_head: int = 12, n_positions: int = 1024
         ) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                                      n_positions=n_positions))


def bert_mlm(num_hidden_layers: int = 4) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(num_hidden_layers=num_hidden_layers))


def bert_classifier(num_hidden_layers: int = 4) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(num_hidden_layers=num_hidden_layers))


def t5_small() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    # T5Config's defaults are t5-small: d_model 512, d_ff 2048, 6+6 layers, 8 heads. The
    # start and pad ids (0 in t5-small's config.json) are needed to shift labels right.
    return T5ForConditionalGeneration(T5Config(decoder_start_token_id=0, pad_token_id=0))


def llama_tiny() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=688,
                                        num_hidden_layers=4, num_attention_heads=4,
                                        num_key_value_heads=4, vocab_size=32000))


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


# -- the cases ---------------------------------------------------------------------------

IMAGE = (3, 224, 224)


def tokens(seq_len: int, vocab: int) -> dict[str, TensorSpec]:
    """``input_ids`` and ``labels`` for a Hugging Face model that computes its own loss."""
    ids = TensorSpec((seq_len,), dtype="int64", high=vocab)
    return {"input_ids": ids, "labels": ids}


def _train(optimizer: str, precision: str = "fp32", **kwargs: Any) -> TrainConfig:
    return TrainConfig(optimizer=optimizer, precision=precision, **kwargs)


def _infer(precision: str = "fp32") -> TrainConfig:
    return TrainConfig(mode="infer", precision=precision)


CASES: tuple[Case, ...] = (
    # vision, convolutional
    Case("resnet50", partial(timm_model, "resnet50"), IMAGE, 8, _train("adamw")),
    Case("resnet50-infer", partial(timm_model, "resnet50"), IMAGE, 16, _infer()),
    Case("mobilenetv3-bf16", partial(timm_model, "mobilenetv3_large_100"), IMAGE, 16,
         _train("momentum", "amp-bf16")),
    Case("efficientnet_b0-ckpt", partial(timm_model, "efficientnet_b0"), IMAGE, 8,
         _train("adamw", checkpointing=True)),
    Case("convnext_tiny-bf16", partial(timm_model, "convnext_tiny"), IMAGE, 4,
         _train("adamw", "amp-bf16")),
    Case("densenet121", partial(timm_model, "densenet121"), IMAGE, 4, _train("momentum")),
    Case("densenet121-ckpt", partial(timm_model, "densenet121"), IMAGE, 4,
         _train("momentum", checkpointing=True)),
    # vision transformer
    Case("vit_small", partial(timm_model, "vit_small_patch16_224"), IMAGE, 8, _train("adamw")),
    Case("vit_small-bf16-ckpt", partial(timm_model, "vit_small_patch16_224"), IMAGE, 8,
         _train("adamw", "amp-bf16", checkpointing=True)),
    # language models (Hugging Face computes the loss from labels)
    Case("gpt2-4l", partial(gpt2, 4), tokens(128, 50257), 4, _train("adamw")),
    Case("gpt2-4l-bf16-ckpt", partial(gpt2, 4), tokens(128, 50257), 4,
         _train("adamw", "amp-bf16", checkpointing=True)),
    Case("gpt2-4l-infer", partial(gpt2, 4), {"input_ids": TensorSpec((128,), "int64", high=50257)},
         8, _infer()),
    Case("bert-base-4l", partial(bert_mlm, 4), tokens(128, 30522), 4, _train("momentum")),
    # no vocabulary-sized logits: the peak is the encoder's activations
    Case("bert-base-4l-cls", partial(bert_classifier, 4),
         {"input_ids": TensorSpec((256,), "int64", high=30522),
          "labels": TensorSpec((), "int64", high=2)}, 16, _train("adamw")),
    Case("t5-small", t5_small, tokens(128, 32128), 4, _train("adamw")),
    Case("llama-tiny-bf16", llama_tiny, tokens(128, 32000), 4, _train("adamw", "amp-bf16")),
    Case("llama-tiny-infer", llama_tiny, {"input_ids": TensorSpec((128,), "int64", high=32000)},
         8, _infer()),
    # recurrent and dense prediction
    Case("lstm", LSTMClassifier, (64, 128), 32, _train("adamw")),
    Case("unet", UNet, (1, 128, 128), 8, _train("adamw", loss_fn=reconstruction_loss)),
    Case("unet-rgb-pure-bf16", partial(UNet, 3), (3, 128, 128), 4,
         _train("momentum", "bf16", loss_fn=reconstruction_loss)),
)

BY_NAME: dict[str, Case] = {case.name: case for case in CASES}


if __name__ == "__main__":
    for case in CASES:
        print(f"{case.name:24s} {case.describe()}")
