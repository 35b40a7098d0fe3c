"""AutoFusedModelForCausalLM: AutoModelForCausalLM that comes back patched."""

from __future__ import annotations

from fuseforge.transformers.dispatch import DEFAULT_OPTIONS, apply_kernels


def _split_options(kwargs: dict) -> dict:
    """Take apply_kernels' keyword arguments out of from_pretrained/from_config's."""
    return {name: kwargs.pop(name) for name in DEFAULT_OPTIONS if name in kwargs}


class AutoFusedModelForCausalLM:
    """Like `transformers.AutoModelForCausalLM`, plus apply_kernels' options (kernel flags,
    loss_chunk_size) as keyword arguments.

    The model is built by AutoModelForCausalLM (any type it knows), then patched with
    `apply_kernels`, which warns when the model type is not a supported family. The
    patch report is available from `fuseforge.transformers.get_patch_report(model)`.
    """

    def __init__(self, *args, **kwargs):
        raise OSError(
            "AutoFusedModelForCausalLM is not instantiated directly: use "
            "AutoFusedModelForCausalLM.from_pretrained(...) or .from_config(...)"
        )

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        from transformers import AutoModelForCausalLM

        options = _split_options(kwargs)
        model = AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        apply_kernels(model, **options)
        return model

    @classmethod
    def from_config(cls, config, **kwargs):
        from transformers import AutoModelForCausalLM

        options = _split_options(kwargs)
        model = AutoModelForCausalLM.from_config(config, **kwargs)
        apply_kernels(model, **options)
        return model
