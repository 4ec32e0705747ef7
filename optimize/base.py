"""The optimize contract: checkpoint + calibration data -> quantized checkpoint + manifest.

Every quantization method is one file in this folder with a pydantic config (its `method`
field is a Literal of its name) and a `Quantizer` subclass registered in `QUANTIZERS`.
A `ModelArtifact` is a folder holding a Hugging Face checkpoint (safetensors only) and
`kiln-artifact.json`, the manifest that says how it was made.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from kiln.core.files import read_json
from kiln.core.registry import Registry

MANIFEST = "kiln-artifact.json"


class QuantizerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    method: str


@dataclass(frozen=True)
class Calibration:
    """Calibration samples as token-id lists, with the hash that keys cached artifacts."""

    samples: list[list[int]]
    sha256: str
    source: str


@dataclass(frozen=True)
class ModelArtifact:
    path: Path
    manifest: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> ModelArtifact:
        path = Path(path)
        manifest = read_json(path / MANIFEST) if (path / MANIFEST).exists() else {}
        return cls(path=path, manifest=manifest)


class Quantizer(abc.ABC):
    """Turns a source checkpoint into a quantized one. Implementations live one per file."""

    name: ClassVar[str]
    needs_calibration: ClassVar[bool] = False
    artifact_format: ClassVar[str] = "safetensors"  # what the output folder holds (engines declare what they read)

    def __init__(self, config: QuantizerConfig):
        self.config = config

    def check(self, model_config: dict[str, Any]) -> None:
        """Refuse, before any work, a config that cannot apply to this model (raise BadInput)."""

    @abc.abstractmethod
    def quantize(self, source: Path, out_dir: Path, calibration: Calibration | None) -> dict[str, Any]:
        """Write the quantized checkpoint into `out_dir`; return method-specific manifest fields
        (for example the modules skipped). The stage adds hashes, versions, timings and sizes."""


QUANTIZERS: Registry[Quantizer] = Registry("quantization method", "method")
