"""A SequenceClassifier that reads right-padded token ids, in the shapes the Trainer's token loss takes."""

from __future__ import annotations

import torch
from torch import nn


class PaddedClassifier(nn.Module):
    """A SequenceClassifier reading right-padded ids (``pad_id`` = padding): logits [B, 1, C], the shape the
    Trainer's token loss takes with targets [B, 1]. A dual classifier (document pairs) reads a pair as
    [B, 2, T], each document right-padded to the longer one; each is cut to its batch's longest real length."""

    def __init__(self, classifier: nn.Module, pad_id: int) -> None:
        super().__init__()
        self.classifier = classifier
        self.pad_id = pad_id

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        dual = getattr(self.classifier, "dual", False)
        want = 3 if dual else 2
        if input_ids.dim() != want or (dual and input_ids.shape[1] != 2):
            raise ValueError(f"input_ids must be {'[B, 2, T] (a document pair)' if dual else '[B, T]'} for this "
                             f"{'dual' if dual else 'single-document'} classifier, got shape {list(input_ids.shape)}")
        if not dual:
            return self.classifier(input_ids, mask=input_ids != self.pad_id)[:, None, :]
        docs = [self._trim(input_ids[:, j]) for j in range(2)]
        return self.classifier(docs[0], docs[1], mask=docs[0] != self.pad_id,
                               mask2=docs[1] != self.pad_id)[:, None, :]

    def _trim(self, ids: torch.Tensor) -> torch.Tensor:
        """Right-padded ids [B, T] without the columns that are padding in every row."""
        longest = int((ids != self.pad_id).sum(1).max())
        return ids[:, :max(longest, 1)]
