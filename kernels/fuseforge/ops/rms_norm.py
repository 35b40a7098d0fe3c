"""PLACEHOLDER: being written; replace this whole file."""

def rms_norm(*args, **kwargs):
    raise NotImplementedError('rms_norm is not written yet')


def fused_add_rms_norm(*args, **kwargs):
    raise NotImplementedError('fused_add_rms_norm is not written yet')


