"""`gguf`: convert a safetensors checkpoint to one GGUF file (f32/f16/bf16) and quantize it with
llama.cpp's quantizer (q8_0, q6_K, q5_0, q4_0, q4_1, iq4_nl, q4_K_M, q5_K_M).

Both come from the llama.cpp build kiln makes at install time (core/llama_cpp_build.py): the
vendored `convert_hf_to_gguf.py` (run with this interpreter; it needs PyPI `gguf`, pinned to the
version it vendors) and `llama_model_quantize` of libllama, called as `llama-quantize` calls it
(optimize/gguf_native.py, in a child process). The artifact folder holds `model.gguf`, the HF
tokenizer files and the manifest; anything that reads GGUF can serve it.

The manifest reads the written file back with the `gguf` reader: bits per weight over all
tensors, the count of each tensor type, and every 2-D tensor that is not at the requested type
(q4_K_M mixes q4_K with q6_K by design, and falls back to q5_0/q8_0 where a row is not a
multiple of the 256-wide k-quant block, e.g. hidden 576).

Tokenizer: the converter picks the vocabulary type from the files. A byte-level BPE
`tokenizer.json` that also carries `byte_fallback: true` and an SPM-style decoder (what
transformers writes when it imports a tokenizer from a GGUF, as the demo checkpoint was) passes
gguf's `LlamaHfVocab` test and is written as an SPM ("llama") vocabulary, which tokenizes
differently and made `llama-perplexity` abort. Neither field changes how a ByteLevel tokenizer
encodes (every byte already has a token), so the converter reads a copy with them set as GPT-2
has them; then llama.cpp's tokenization of sample text is compared with the HF tokenizer's and a
mismatch is refused.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from kiln.optimize.architecture import DecoderShapes
from kiln.optimize.base import QUANTIZERS, Calibration, Quantizer, QuantizerConfig
from kiln.optimize.checkpoint import copy_side_files, safetensors_files
from kiln.optimize.memory import DTYPE_BYTES, RUNTIME_BYTES, Component, MethodMemory, runtime, source_dtype
from kiln.core.errors import BadInput
from kiln.core.files import atomic_write_bytes

log = logging.getLogger("kiln")

GGUF_FILE = "model.gguf"
CONVERT_TYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16"}  # the converter's --outtype -> tensor type
# ftype -> (llama-quantize name, main type). iq4_nl: 4-bit blocks of 32 on a non-uniform grid; on x86
# llama.cpp repacks it (as q4_0 and q4_K, not q4_1, q5_0, q6_K or q8_0) for a faster matmul.
QUANT_TYPES = {"q8_0": ("Q8_0", "Q8_0"), "q6_K": ("Q6_K", "Q6_K"), "q5_0": ("Q5_0", "Q5_0"),
               "q4_0": ("Q4_0", "Q4_0"), "q4_1": ("Q4_1", "Q4_1"), "iq4_nl": ("IQ4_NL", "IQ4_NL"),
               "q4_K_M": ("Q4_K_M", "Q4_K"), "q5_K_M": ("Q5_K_M", "Q5_K")}
BITS = {"f32": 32, "f16": 16, "bf16": 16, "q8_0": 8.5, "q6_K": 6.5625, "q5_0": 5.5, "q4_0": 4.5, "q4_1": 5.0,
        "iq4_nl": 4.5, "q4_K_M": 4.85, "q5_K_M": 5.7}  # nominal
# Text the tokenizer check always covers: spaces, digits, punctuation, accents, code, newlines.
SAMPLE_TEXT = (
    "The quick brown fox jumps over the lazy dog.",
    "  Leading spaces, trailing spaces   and\ttabs\n\nnew lines.",
    "Numbers: 3.14159, 1,000,000 and 2026-12-01; prices $4.99 (€5).",
    "It is a truth universally acknowledged, that a single man in possession of a good fortune...",
    "naïve café résumé — Zürich, São Paulo, Kraków",
    "def f(x):\n    return x ** 2  # square\n",
    "\"Quoted\" 'text' with CAPITALS, mIxEd case and e-mail@example.com",
)


class GgufConfig(QuantizerConfig):
    method: Literal["gguf"] = "gguf"
    type: Literal["f32", "f16", "bf16", "q8_0", "q6_K", "q5_0", "q4_0", "q4_1", "iq4_nl", "q4_K_M", "q5_K_M"] = Field(
        "q8_0", description="GGUF tensor type: f32/f16/bf16 straight from the converter, the rest via llama-quantize")
    threads: int | None = Field(None, ge=1, description="llama-quantize threads; None: all cores")


@QUANTIZERS.register("gguf", GgufConfig)
class Gguf(Quantizer):
    config: GgufConfig
    artifact_format: ClassVar[str] = "gguf"

    def quantize(self, source: Path, out_dir: Path, calibration: Calibration | None) -> dict[str, Any]:
        source, out_dir = Path(source), Path(out_dir)
        safetensors_files(source)
        out_dir.mkdir(parents=True, exist_ok=True)
        kind = self.config.type
        target = out_dir / GGUF_FILE
        if kind in CONVERT_TYPES:
            convert(source, target, kind)
        else:
            # The full-precision GGUF llama-quantize reads, in the dtype the checkpoint stores: widening
            # bf16 or fp16 to f32 is exact, so an f32 file would only take twice the disk (32 GB for an 8B).
            outtype = _lossless_outtype(source)
            with tempfile.TemporaryDirectory(dir=out_dir, prefix=f".{outtype}-") as tmp:
                full = Path(tmp) / f"model-{outtype}.gguf"
                convert(source, full, outtype)
                quantize_file(full, target, kind, self.config.threads)
        copy_side_files(source, out_dir)
        shutil.copy2(source / "config.json", out_dir / "config.json")
        texts = list(SAMPLE_TEXT) + sample_texts(source, calibration)
        checked = check_tokenizer(target, source, texts)
        return {"format": "gguf", "file": GGUF_FILE, "type": kind, **describe(target, kind),
                "tokenizer_check": checked, "loads_with": "llama.cpp (llama-server, llama-cli) or any GGUF reader"}

    @staticmethod
    def memory(shapes: DecoderShapes, config: GgufConfig, source_dtype: str) -> MethodMemory:
        # Neither tool loads the model whole: the converter reads the checkpoint lazily and writes one
        # tensor at a time (to a file: the intermediate GGUF is disk, not memory), then llama-quantize works
        # tensor by tensor. The converter holds about the largest tensor as stored, widened to float32, and
        # (a 16-bit checkpoint: the intermediate keeps its dtype) narrowed again as written, beside its
        # libraries (bench/scale.py: 2.47 GiB converter peak for a 1.24B Llama whose embedding has 263M
        # params, 4.43 GiB at 8B with 525M).
        largest = shapes.largest_matrix
        stored = DTYPE_BYTES.get(source_dtype, 4.0)
        written = stored if stored < 4.0 else 0.0  # float32 is written as it is held
        work = [runtime("torch + transformers"),
                Component("converter process (torch)", RUNTIME_BYTES["torch + transformers"],
                          "convert_hf_to_gguf.py imports torch: resident size after import, measured"),
                Component("largest tensor, as stored, in float32 and as written", largest * (stored + 4.0 + written),
                          f"{largest / 1e6:.1f}M params × ({stored:g} + 4 + {written:g}) B; one tensor at a time")]
        serve = Component(f"weights ({config.type})", shapes.param_count * BITS[config.type] / 8,
                          f"{shapes.param_count / 1e6:.1f}M params × ~{BITS[config.type]:g} bit")
        return MethodMemory(work, serve, serving_dtype="float16")


def _tool(name: str) -> Path:
    from kiln.core.llama_cpp_build import binary, converter

    path = converter() if name == "convert_hf_to_gguf.py" else binary(name)
    if path is None:
        raise BadInput(f"llama.cpp's {name} is not built on this machine: run `make llama-cpp` "
                       "(or `python -m kiln.core.llama_cpp_build`) to build it once.")
    return path


def _stage(source: Path, stage: Path) -> None:
    """A view of `source` for the converter: links to every file, the tokenizer fixed (module doc)."""
    for p in source.iterdir():
        if p.is_file() and p.name != "tokenizer.json":
            os.symlink(p.resolve(), stage / p.name)
    tok_path = source / "tokenizer.json"
    if not tok_path.is_file():
        return
    tok = json.loads(tok_path.read_text(encoding="utf-8"))
    if (tok.get("model", {}).get("type") == "BPE" and (tok.get("pre_tokenizer") or {}).get("type") == "ByteLevel"
            and tok["model"].get("byte_fallback")):
        tok["model"]["byte_fallback"] = False
        tok["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    # Atomic like every file kiln writes, but not scrubbed (atomic_write_text): this is the model's vocabulary,
    # and a token holding a remembered credential (a short password, say) would be masked in the GGUF.
    atomic_write_bytes(stage / "tokenizer.json", json.dumps(tok, ensure_ascii=False).encode("utf-8"))


def _lossless_outtype(source: Path) -> str:
    """The converter's --outtype that holds the checkpoint's weights exactly: bf16 or f16 as stored, else f32."""
    stored = source_dtype(json.loads((source / "config.json").read_text()))
    return {"bfloat16": "bf16", "float16": "f16"}.get(stored, "f32")


def convert(source: Path, target: Path, outtype: str) -> None:
    """safetensors checkpoint -> one GGUF file at f32/f16/bf16."""
    script = _tool("convert_hf_to_gguf.py")
    with tempfile.TemporaryDirectory(prefix="kiln-gguf-stage-") as tmp:
        # The converter names the model (general.name) after the folder it reads: the source's own
        # name, not the random temporary one, so the same checkpoint converts to the same bytes.
        view = Path(tmp) / Path(source).resolve().name
        view.mkdir()
        _stage(Path(source), view)
        proc = subprocess.run([sys.executable, str(script), str(view), "--outfile", str(target), "--outtype", outtype],
                              check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-6:])
        raise BadInput(f"{source}: llama.cpp's convert_hf_to_gguf.py cannot convert this checkpoint:\n{tail}")


def quantize_file(src: Path, target: Path, kind: str, threads: int | None = None) -> None:
    """llama-quantize's work through llama.cpp's C API (optimize/gguf_native.py), in a child process."""
    cmd = [sys.executable, "-m", "kiln.optimize.gguf_native", "quantize", str(src), str(target), QUANT_TYPES[kind][0]]
    if threads:
        cmd.append(str(threads))
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"quantizing to {kind} failed: {proc.stderr.strip()[-800:]}")


def describe(path: Path, kind: str | None = None) -> dict[str, Any]:
    """What the GGUF file holds, read back from it: bits per weight, tensor types, fallbacks."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    types: dict[str, int] = {}
    others: dict[str, str] = {}
    main = CONVERT_TYPES.get(kind or "") or (QUANT_TYPES[kind][1] if kind in QUANT_TYPES else None)
    elements = nbytes = 0
    for t in reader.tensors:
        name = t.tensor_type.name
        types[name] = types.get(name, 0) + 1
        elements += int(t.n_elements)
        nbytes += int(t.n_bytes)
        if main and len(t.shape) > 1 and name != main:
            others[t.name] = name
    field = reader.get_field("tokenizer.ggml.model")
    tokenizer = bytes(field.parts[field.data[0]]).decode() if field else None
    return {"bits_per_weight": round(8 * nbytes / elements, 3), "tensor_types": dict(sorted(types.items())),
            "tensors_not_at_type": others, "tensor_bytes": nbytes, "file_bytes": path.stat().st_size,
            "params": elements, "tokenizer_model": tokenizer}


def sample_texts(source: Path, calibration: Calibration | None, n: int = 8) -> list[str]:
    """Up to n calibration samples as text (when the method is given calibration data)."""
    if calibration is None or not calibration.samples:
        return []
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(source))
    return [tok.decode(s[:256], skip_special_tokens=True) for s in calibration.samples[:n]]


def llama_tokenize(gguf_path: Path, texts: list[str]) -> list[list[int]]:
    """llama.cpp's own tokenization of each text (no BOS, special tokens not parsed), in one child process."""
    proc = subprocess.run([sys.executable, "-m", "kiln.optimize.gguf_native", "tokenize", str(gguf_path)],
                          input=json.dumps(texts), check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp's tokenizer failed on {gguf_path}: {proc.stderr.strip()[-800:]}")
    return json.loads(proc.stdout)


def check_tokenizer(gguf_path: Path, hf_dir: Path, texts: list[str]) -> dict[str, Any]:
    """Refuse a GGUF whose tokenizer splits any of `texts` differently from the HF tokenizer."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(hf_dir))
    try:
        ours = llama_tokenize(gguf_path, texts)
    except RuntimeError as e:  # a vocabulary llama.cpp cannot even load (std::out_of_range)
        raise BadInput(f"{gguf_path}: llama.cpp cannot tokenize with this GGUF's vocabulary (type "
                       f"{describe(gguf_path)['tokenizer_model']!r}; {hf_dir}/tokenizer.json is the model's): "
                       f"{e}. Fix tokenizer.json, or convert with a llama.cpp that knows this tokenizer.") from e
    for text, got in zip(texts, ours, strict=True):
        want = hf(text, add_special_tokens=False).input_ids
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise BadInput(
                f"{gguf_path}: llama.cpp tokenizes {text[:60]!r} differently from {hf_dir}/tokenizer.json "
                f"(first difference at token {at}: {got[at:at + 4]} vs {want[at:at + 4]}; vocabulary type "
                f"{describe(gguf_path)['tokenizer_model']!r}). The GGUF's tokenizer is not the model's: fix "
                "tokenizer.json (or convert with a llama.cpp that knows this pre-tokenizer).")
    return {"texts": len(texts), "tokens": sum(len(hf(t, add_special_tokens=False).input_ids) for t in texts),
            "identical": True}
