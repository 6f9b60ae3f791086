"""A small nanoGPT-style causal transformer for byte-level language modelling."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from vatra.config import ModelConfig
from vatra.data import DatasetSpec
from vatra.errors import ConfigError


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention.

    The fused ``qkv`` projection's output rows are head-major, ``(head, q|k|v, head_dim)``, so that
    splitting them in contiguous chunks (column-wise tensor parallelism) gives each rank whole heads
    with their own q, k and v; :mod:`vatra.parallel.tp` then sets ``n_head`` to the rank's share.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head  # heads this module computes (n_head / tp under tensor parallelism)
        self.head_dim = n_embd // n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        qkv = self.qkv(x).view(B, T, self.n_head, 3, self.head_dim)  # (B, T, H, 3, D)
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # 3 x (B, H, T, D)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)  # (B, T, H·D)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout)
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + learned position embeddings, pre-LN blocks, final LayerNorm, weight-tied head."""

    def __init__(
        self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float
    ):
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: one (vocab, n_embd) matrix
        # Small-normal init as in GPT-2: PyTorch's N(0, 1) embedding default, read through the
        # tied head, would start with logits of std ≈ sqrt(n_embd) and a far-too-high loss.
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: Tensor) -> Tensor:
        seq_len = idx.shape[1]  # idx: (B, T)
        if seq_len > self.block_size:
            raise ValueError(f"sequence length {seq_len} exceeds block_size {self.block_size}")
        pos = torch.arange(seq_len, device=idx.device)  # (T,)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, vocab)


def build_gpt(cfg: ModelConfig, spec: DatasetSpec) -> GPT:
    if spec.kind != "lm":
        raise ConfigError("model.name: 'gpt' needs a language-modelling dataset; use data.name = 'text'")
    return GPT(spec.num_classes, spec.input_shape[0], cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.dropout)
