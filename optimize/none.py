"""`none`: the baseline. Passes the checkpoint through unchanged.

Every comparison kiln makes is candidate vs baseline, and both go through the same stage so
they have the same shape (a folder with a manifest). The weights are copied, never hardlinked:
the baseline is what the gate judged, and a hardlink would let `cp new.safetensors` into the user's
folder change it. The copy is a reflink where the filesystem offers one (btrfs, XFS: no disk space
until either side is written), else a full copy of the bytes.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Literal

from kiln.optimize.architecture import DecoderShapes
from kiln.optimize.base import QUANTIZERS, Calibration, Quantizer, QuantizerConfig
from kiln.optimize.checkpoint import (
    bits_per_weight,
    copy_file,
    copy_side_files,
    param_count,
    safetensors_files,
)
from kiln.optimize.memory import DTYPE_BYTES, MethodMemory, weights


class NoneConfig(QuantizerConfig):
    method: Literal["none"] = "none"


@QUANTIZERS.register("none", NoneConfig)
class PassThrough(Quantizer):
    def quantize(self, source: Path, out_dir: Path, calibration: Calibration | None) -> dict[str, Any]:
        source, out_dir = Path(source), Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        weights = safetensors_files(source)
        index = source / "model.safetensors.index.json"
        how = {copy_file(p, out_dir / p.name) for p in weights}
        for p in (source / "config.json", index):
            if p.is_file():  # small files are copied: the stage may rewrite them in the output
                shutil.copy2(p, out_dir / p.name)
        copy_side_files(source, out_dir)
        return {
            "format": "unchanged",
            "weights": "reflink" if how == {"reflink"} else "copy",
            "quantized_modules": 0,
            "skipped_modules": [],
            "bits_per_weight": round(bits_per_weight(out_dir, param_count(source)), 3),
        }

    @staticmethod
    def memory(shapes: DecoderShapes, config: QuantizerConfig, source_dtype: str) -> MethodMemory:
        # Copying files streams them: nothing is loaded.
        return MethodMemory(working_set=[], serving_weights=weights(shapes, DTYPE_BYTES[source_dtype], source_dtype),
                            serving_dtype=source_dtype)
