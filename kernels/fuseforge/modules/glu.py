"""PLACEHOLDER: being written; replace this whole file."""

import torch

class SwiGLUMLP(torch.nn.Module):
    pass


class GeGLUMLP(torch.nn.Module):
    pass


