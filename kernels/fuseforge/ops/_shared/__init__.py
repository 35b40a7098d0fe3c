"""What the ops share and nobody else should import: row-wise launch helpers, a launch path that reuses compiled
kernels, tensor checks (the LM-head inputs' among them), gradient scaling, target scanning, the cross-entropy
tile math of both logits layouts and the vocab-major pieces of the fused losses. What modules, optim and
transformers share with the ops lives in public modules: fuseforge.loss_args, fuseforge.checks."""
