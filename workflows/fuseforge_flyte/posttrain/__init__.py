"""Post-training on the platform: preference optimisation (DPO through TRL on fuseforge's fused DPO loss,
reference log-probs from a separate cached task) and distillation (the engine with a teacher, fused
linear JSD)."""
