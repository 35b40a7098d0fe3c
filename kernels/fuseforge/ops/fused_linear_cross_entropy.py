"""PLACEHOLDER: being written; replace this whole file."""

def fused_linear_cross_entropy(*args, **kwargs):
    raise NotImplementedError('fused_linear_cross_entropy is not written yet')


