"""PLACEHOLDER: being written; replace this whole file."""

import torch

class CrossEntropyLoss(torch.nn.Module):
    pass


class FusedLinearCrossEntropyLoss(torch.nn.Module):
    pass


