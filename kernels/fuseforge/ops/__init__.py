"""Triton kernels and their torch.autograd.Function wrappers, one op per module.

Each module keeps its kernels, launch helpers and autograd.Function together;
`fuseforge.functional` is the public entry point.
"""
