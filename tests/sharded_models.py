"""Small models for the sharded tests, importable by the real runs' worker processes.

Each model says what a trace must see: ``TinyTransformer`` has token embeddings, a
LayerNorm and an MLP per block, a head over the vocabulary (97, odd so FSDP's last
rank gets a short shard); ``TinyCNN`` has convolutions with BatchNorm (buffers, which
DDP broadcasts every forward).
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 97
SEQ = 16


class Block(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TinyTransformer(nn.Module):
    def __init__(self, width: int = 64, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x).float().mean()


class TinyCNN(nn.Module):
    def __init__(self, channels: int = 16) -> None:
        super().__init__()
        self.stages = nn.ModuleList(
            nn.Sequential(nn.Conv2d(3 if i == 0 else channels, channels, 3, padding=1),
                          nn.BatchNorm2d(channels), nn.ReLU())
            for i in range(3))
        self.head = nn.Linear(channels, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = stage(x)
        return self.head(x.mean((2, 3)))


def transformer_inputs():
    from batchfit.engine.spec import TensorSpec

    return TensorSpec((SEQ,), "int64", 0, VOCAB)


CNN_INPUTS = (3, 16, 16)


def tiny_llama():
    """A 2-layer Llama (4 heads, 2 key-value heads) built by transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def llama_inputs():
    from batchfit.engine.spec import TensorSpec

    ids = TensorSpec((SEQ,), "int64", 0, 128)
    return {"input_ids": ids, "labels": ids}
