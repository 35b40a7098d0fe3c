"""What the ops share and nobody else should import: loss arguments, row-wise launch helpers, a launch path that
reuses compiled kernels, input checks, gradient scaling, target scanning and the vocabulary-major cross-entropy
pieces of the fused losses."""
