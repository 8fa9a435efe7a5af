"""Pydantic configs for each stage: validated at construction, ``extra="forbid"``, errors name the field.

Field names equal the CLI flags (``top_p`` ↔ ``--top-p``), so a validation error names the flag to fix.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class SamplingConfig(BaseModel):
    """How tokens are chosen: greedy at ``temperature == 0``, else temperature → top-k → renormalise → top-p."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(0.0, ge=0.0, description="0 = greedy; > 0 scales logits by 1/temperature.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens (ties at the k-th kept); 0 = off.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass in (0, 1]; 1 = off.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class DecodeConfig(BaseModel):
    """Speculative decoding settings."""

    model_config = ConfigDict(extra="forbid")

    num_speculative_tokens: int = Field(5, ge=1, le=64, description="γ: draft tokens per target pass.")
    max_new_tokens: int = Field(128, ge=1, description="New tokens per prompt (met exactly unless EOS/stop).")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    seed: int = Field(0, description="Seed of the sampling generator.")
