"""PLACEHOLDER: being written; replace this whole file."""

def layer_norm(*args, **kwargs):
    raise NotImplementedError('layer_norm is not written yet')


