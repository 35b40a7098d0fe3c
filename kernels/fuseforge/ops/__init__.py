"""Triton kernels and their torch.autograd.Function wrappers, one public op per module (what they share: _shared).

Each module keeps its kernels, launch helpers and autograd.Function together;
`fuseforge.functional` is the public entry point.
"""
