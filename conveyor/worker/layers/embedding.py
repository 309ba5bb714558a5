"""Token embedding and LM head, split across ranks along the vocabulary.

Each rank holds ceil(vocab / tp) rows (the last rank's tail is zero padding). The embedding
looks up the ids it owns and all-reduces; the head computes its slice of the logits and
all-gathers them.

Either may be quantized (quantization.py): the head then runs a quantized linear(); the
embedding gathers 1-byte rows and their scales and dequantizes what it looked up.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.worker.layers.linear import linear
from conveyor.worker.layers.parallel import all_gather_last_dim, all_reduce, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.rows_per_rank = -(-num_embeddings // tp_size())
        self.vocab_start = tp_rank() * self.rows_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.register_parameter("weight_scale", None)   # [rows, 1] when quantized
        self.dtype = dtype                                 # of the output, quantized or not

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(f"vocab size mismatch: model {self.num_embeddings}, "
                             f"checkpoint {loaded_weight.shape[0]}")
        rows = loaded_weight[self.vocab_start:self.vocab_start + self.rows_per_rank]
        param.data.zero_()
        param.data[:rows.shape[0]].copy_(rows)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of this rank's weight [T, hidden], in the model's dtype."""
        if self.weight_scale is None:
            return F.embedding(ids, self.weight)
        rows = F.embedding(ids, self.weight.view(torch.int8)).view(self.weight.dtype)
        return (rows.float() * F.embedding(ids, self.weight_scale)).to(self.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return self.lookup(input_ids)                # [T, hidden]
        local = input_ids - self.vocab_start
        owned = (local >= 0) & (local < self.rows_per_rank)
        out = self.lookup(torch.where(owned, local, 0))
        return all_reduce(out * owned.unsqueeze(-1).to(out.dtype))


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> logits over the full vocabulary; `weight` may be the embedding's (tied)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # [N, rows_per_rank * tp]
        logits = all_gather_last_dim(linear(hidden, self.weight, scale=self.weight_scale))
        return logits[..., :self.num_embeddings]
