"""The dpo workflow's Flyte layer: its tasks (preference data, reference log-probs, the policy) and its Deck.

What they run is plain code without Flyte: the DPO engine in training/dpo.py (TRL's DPOTrainer on fuseforge's
fused DPO loss), the preference data in data/preferences.py. Distillation is the engine's own (training/distill.py).
"""
