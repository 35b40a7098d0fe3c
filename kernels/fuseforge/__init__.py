"""fuseforge: fused Triton kernels for LLM training.

`fuseforge.functional` holds the differentiable ops, `fuseforge.modules` the
drop-in nn.Modules and `fuseforge.transformers` the one-line Hugging Face patching.
Submodules are imported lazily so that `import fuseforge` stays cheap.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
