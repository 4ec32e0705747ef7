"""The recipe's `evaluate.quality.lmeval` section, and the batch size the `KilnLM` adapter uses
when none is given. Light on purpose: `kiln validate` reads it without importing lm-eval, and
both the task runner (lmeval.py) and the adapter (lmeval_adapter.py) import it, never each other
for it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kiln.evaluate.tasks import SHIPPED
from kiln.core.registry import did_you_mean

DEFAULT_BATCH_SIZE = 64


class LmEvalConfig(BaseModel):
    """The recipe's `evaluate.quality.lmeval` section."""

    model_config = ConfigDict(extra="forbid")
    tasks: list[str] = Field(default_factory=lambda: list(SHIPPED), min_length=1,
                             description=f"kiln's shipped tasks ({', '.join(SHIPPED)}) or paths to lm-eval task YAMLs")
    limit: int | None = Field(None, ge=1, description="documents per task (None: all)")
    batch_size: int = Field(DEFAULT_BATCH_SIZE, ge=1, description="log-likelihood requests per engine.score call")

    @field_validator("tasks")
    @classmethod
    def _known(cls, tasks: list[str]) -> list[str]:
        for t in tasks:
            if t not in SHIPPED and not t.endswith((".yaml", ".yml")):
                raise ValueError(f"unknown task '{t}'.{did_you_mean(t, list(SHIPPED))} "
                                 "Or give the path of an lm-eval task YAML (ending .yaml).")
        if len(set(tasks)) != len(tasks):
            raise ValueError("a task is listed twice")
        return tasks
