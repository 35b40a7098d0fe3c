"""PLACEHOLDER: being written; replace this whole file."""

def cross_entropy(*args, **kwargs):
    raise NotImplementedError('cross_entropy is not written yet')


