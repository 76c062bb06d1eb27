"""The character GRU several Python suites probe and train (test_probing.py, the DDP own-loop
worker): characters -> embedding 24 -> GRU 64 -> next-character logits; memory grows with bs*l."""
import torch

VOCAB = 60


class CharGru(torch.nn.Module):
    """``loss_sum(chars)`` (also its ``forward``, for DistributedDataParallel): the summed
    next-character cross-entropy of a [bs, l] batch of character codes in [1, VOCAB)."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB, 24)
        self.gru = torch.nn.GRU(24, 64, batch_first=True)
        self.head = torch.nn.Linear(64, VOCAB)

    def loss_sum(self, chars):
        hidden, _ = self.gru(self.embedding(chars[:, :-1]))
        return torch.nn.functional.cross_entropy(self.head(hidden).reshape(-1, VOCAB), chars[:, 1:].reshape(-1),
                                                 reduction="sum")

    def forward(self, chars):
        return self.loss_sum(chars)
