"""The UCI Adult example's dense model: embeddings and numerics -> MLP -> one logit."""

from collections.abc import Sequence
from typing import List  # noqa: UP035  (TorchScript reads the forward signature)

import torch
from torch import nn

__all__ = ["AdultDNN"]


class AdultDNN(nn.Module):
    """``concat(embeddings..., numerics...) -> [Linear -> ReLU] * len(hidden) -> Linear(1)``.

    Args:
        slot_dims: embedding width of each slot, in the order of the ``embedding_tensors``
            passed to :meth:`forward`.
        num_numeric: total width of the ``non_id_tensors`` passed to :meth:`forward`.
        hidden: widths of the hidden layers.

    Scriptable with ``torch.jit.script``; deterministic (no dropout or batch norm).
    """

    def __init__(
        self, slot_dims: Sequence[int], num_numeric: int, hidden: Sequence[int] = (128, 64)
    ) -> None:
        super().__init__()
        if not slot_dims and num_numeric <= 0:
            raise ValueError("AdultDNN needs at least one slot or one numeric input")
        if any(int(d) <= 0 for d in slot_dims) or num_numeric < 0:
            raise ValueError(f"bad widths: slot_dims {list(slot_dims)}, num_numeric {num_numeric}")
        self.slot_dims = [int(d) for d in slot_dims]
        self.num_numeric = int(num_numeric)
        layers: list[nn.Module] = []
        width = sum(self.slot_dims) + self.num_numeric
        for h in hidden:
            layers += [nn.Linear(width, int(h)), nn.ReLU()]
            width = int(h)
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(
        self,
        non_id_tensors: List[torch.Tensor],  # noqa: UP006
        embedding_tensors: List[torch.Tensor],  # noqa: UP006
    ) -> torch.Tensor:
        """Logits float32 [batch, 1] from embeddings [batch, dim_i] and numerics [batch, k]."""
        x = torch.cat(embedding_tensors + non_id_tensors, dim=1)
        return self.mlp(x)
