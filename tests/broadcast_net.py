"""A tiny model whose parameters reach the loss through broadcasts outside any module
(tests/test_broadcast_grads.py): a ViT's ``cls_token.expand`` + ``cat`` and a sliced
``pos_embed``, GPT-2's ``wte(tokens) + wpe(position_ids)`` with position_ids of shape (1, T), a
layer scale and bias ``h * gamma + beta``, and ``beta`` used a second time.
"""
from __future__ import annotations

import torch
from torch import nn

VOCAB, T, D, CLASSES = 23, 5, 8, 4


class BroadcastNet(nn.Module):
    """Every parameter outside the Linear/Embedding/LayerNorm modules is broadcast over the batch."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D)
        self.wpe = nn.Embedding(T + 2, D)
        self.cls_token = nn.Parameter(torch.randn(1, 1, D))
        self.pos_embed = nn.Parameter(torch.randn(1, T + 3, D) * 0.5)  # sliced to T + 1 below
        self.ln = nn.LayerNorm(D)
        self.gamma = nn.Parameter(torch.rand(D) + 0.5)
        self.beta = nn.Parameter(torch.randn(D) * 0.1)
        self.fc = nn.Linear(D, D)
        self.act = nn.GELU()
        self.head = nn.Linear(D, CLASSES)

    def forward(self, tokens):
        b, t = tokens.shape
        position_ids = torch.arange(t, device=tokens.device).unsqueeze(0)  # (1, T), as HF GPT-2
        h = self.wte(tokens) + self.wpe(position_ids)  # (b) a det module's output, broadcast
        h = torch.cat([self.cls_token.expand(b, -1, -1), h], dim=1)  # (a) the cls token
        h = h + self.pos_embed[:, : t + 1]  # (a), (d) a slice of a parameter
        h = self.ln(h) * self.gamma + self.beta  # (c) layer scale and bias
        h = h + self.act(self.fc(h)) + self.beta  # (e) beta a second time
        return self.head(h[:, 0])

