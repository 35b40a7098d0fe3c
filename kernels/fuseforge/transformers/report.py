"""What a patch did: which kernels replaced which modules, and what was left alone and why."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# The flags of apply_kernels, in the order reports list them.
KERNEL_FLAGS = ("rms_norm", "layer_norm", "rope", "swiglu", "fused_linear_cross_entropy", "cross_entropy", "lora")

# Flags that act on adapters (peft), which most models have none of: "nothing to patch" goes unsaid.
ADAPTER_FLAGS = ("lora",)


@dataclass
class PatchReport:
    """Outcome of `apply_kernels` for one model (or, for a class, what its instances will get).

    `patched[kernel]` counts replaced modules by their original class name (for the
    losses: the causal-LM class whose loss now goes through the kernel); `skipped[kernel]`
    gives one reason per thing that looked like a target but was left unfused. Reasons in
    `known_limits` are what the family table (families.Family.unfused) declares the kernels
    cannot do for this family: reported, but no cause for a warning.
    A requested kernel with neither entry had nothing to act on in this model.
    """

    target: str
    model_type: str | None
    family: str | None
    flags: dict[str, bool]
    loss_chunk_size: int | None = None  # tokens per fused-loss chunk; None: the op's default rule
    patched: dict[str, Counter] = field(default_factory=dict)
    skipped: dict[str, list[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    known_limits: list[str] = field(default_factory=list)

    @property
    def supported(self) -> bool:
        """True when the model type is one of the families fuseforge knows end to end."""
        return self.family is not None

    def add_patched(self, kernel: str, what: str, count: int = 1) -> None:
        self.patched.setdefault(kernel, Counter())[what] += count

    def add_skipped(self, kernel: str, reason: str) -> None:
        reasons = self.skipped.setdefault(kernel, [])
        if reason not in reasons:
            reasons.append(reason)

    def add_known_limit(self, kernel: str, reason: str) -> None:
        self.add_skipped(kernel, reason)
        if reason not in self.known_limits:
            self.known_limits.append(reason)

    def patched_kernels(self) -> list[str]:
        return [k for k in KERNEL_FLAGS if self.patched.get(k)]

    def needs_warning(self) -> bool:
        return not self.supported or any(
            reason not in self.known_limits for reasons in self.skipped.values() for reason in reasons
        )

    def summary(self) -> str:
        kind = f"model type {self.model_type!r}" if self.model_type else "model of unknown type"
        family = f"fuseforge family {self.family!r}" if self.family else "not a supported fuseforge family"
        lines = [f"fuseforge patch of {self.target} ({kind}, {family}):"]
        for kernel in KERNEL_FLAGS:
            if not self.flags.get(kernel):
                continue
            done = self.patched.get(kernel)
            if done:
                parts = ", ".join(f"{n} x {name}" for name, n in sorted(done.items()))
                lines.append(f"  {kernel}: patched ({parts})")
            for reason in self.skipped.get(kernel, []):
                known = " (a known limitation for this family)" if reason in self.known_limits else ""
                lines.append(f"  {kernel}: NOT patched: {reason}{known}")
            if not done and not self.skipped.get(kernel) and kernel not in ADAPTER_FLAGS:
                lines.append(f"  {kernel}: nothing to patch")
            if kernel == "fused_linear_cross_entropy" and self.loss_chunk_size is not None:
                lines.append(f"  {kernel}: {self.loss_chunk_size} tokens per chunk (loss_chunk_size)")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()
