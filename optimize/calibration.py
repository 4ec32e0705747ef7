"""Calibration data: text the quantizer runs through the model to measure what it quantizes.

The recipe names a local .txt file, a .jsonl file with a "text" field, or "demo" (kiln's Austen
calibration text). It is loaded with `datasets` from the local file (offline), tokenized with
the model's tokenizer as one stream, cut into `seq_len`-token chunks, and `samples` chunks are
drawn with `seed`. The hash covers the token ids and the tokenizer files, so changing the text,
the sampling or the tokenizer invalidates a cached quantized artifact.

`check_disjoint` refuses calibration text that overlaps the evaluation text: calibrating on
what you then score flatters the quantized model.
"""

from __future__ import annotations

import hashlib
import random
import re
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from kiln.optimize.base import Calibration
from kiln.core.errors import BadInput
from kiln.core.files import hash_of, sha256_file

FIELD = "optimize.calibration"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                    "merges.txt", "tokenizer.model", "added_tokens.json")


class CalibrationConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dataset: str = Field("demo", description="'demo' (kiln's Austen calibration text) or a local .txt or "
                                             ".jsonl file (one JSON object per line with a 'text' field)")
    samples: int = Field(64, ge=1, description="number of token chunks")
    seq_len: int = Field(256, ge=16, description="tokens per chunk")
    seed: int = Field(0, description="which chunks are drawn")


def resolve_dataset(dataset: str) -> Path:
    """A local calibration file, checked. 'demo' is resolved by the pipeline, which hands the file
    to `build_calibration`: a quantizer knows no demo."""
    if dataset == "demo":
        raise BadInput(f"{FIELD}.dataset: 'demo' names the pipeline's demo text; resolve it first "
                       "(the pipeline's optimize stage does) and pass the file as build_calibration(text=...)")
    path = Path(dataset).expanduser()
    if not path.is_file():
        raise BadInput(f"{FIELD}.dataset: {dataset} is not a file. Give 'demo' or a local .txt / .jsonl file.")
    if path.suffix not in (".txt", ".jsonl"):
        raise BadInput(f"{FIELD}.dataset: {dataset} has suffix '{path.suffix}'; expected .txt (plain text) "
                       "or .jsonl (a 'text' field per line).")
    return path


def load_text(path: Path) -> str:
    """The file's text through `datasets` (local files only, cache in a throwaway folder)."""
    from datasets import load_dataset

    builder = "text" if path.suffix == ".txt" else "json"
    with tempfile.TemporaryDirectory(prefix="kiln-calib-") as cache:
        try:
            ds = load_dataset(builder, data_files=str(path), split="train", cache_dir=cache)
        except Exception as e:  # datasets raises many types for a malformed file
            raise BadInput(f"{FIELD}.dataset: cannot read {path}: {e}") from e
        if "text" not in ds.column_names:
            raise BadInput(f"{FIELD}.dataset: {path} has no 'text' field (fields: {', '.join(ds.column_names)}).")
        rows = [t for t in ds["text"] if isinstance(t, str)]
    return "\n".join(rows)


def tokenizer_identity(tokenizer_dir: Path) -> str:
    """Hash of the tokenizer's files: the same text tokenized differently is different data."""
    h = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        p = Path(tokenizer_dir) / name
        if p.is_file():
            h.update(name.encode() + b"\0" + sha256_file(p).encode())
    return h.hexdigest()


def build_calibration(config: CalibrationConfig, tokenizer_dir: Path, text: Path | None = None) -> Calibration:
    """Tokenize the calibration text (`text`, the file the pipeline resolved `config.dataset` to, or
    the local file it names) into `config.samples` chunks of `config.seq_len` tokens."""
    from transformers import AutoTokenizer

    path = Path(text) if text is not None else resolve_dataset(config.dataset)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=False)
    ids = tok(load_text(path), add_special_tokens=False)["input_ids"]
    # Start each chunk with BOS when the tokenizer adds one: that is what the model sees at inference.
    bos = [tok.bos_token_id] if tok.bos_token_id is not None and \
        tok("a")["input_ids"][:1] == [tok.bos_token_id] else []
    body = config.seq_len - len(bos)
    chunks = len(ids) // body
    if chunks < config.samples:
        raise BadInput(f"{FIELD}.samples: {config.samples} samples of {config.seq_len} tokens need "
                       f"{config.samples * body:,} tokens; {path} has {len(ids):,}. Lower {FIELD}.samples "
                       f"or {FIELD}.seq_len, or give a longer file.")
    picked = sorted(random.Random(config.seed).sample(range(chunks), config.samples))
    samples = [bos + ids[i * body:(i + 1) * body] for i in picked]
    digest = hash_of({"tokenizer": tokenizer_identity(Path(tokenizer_dir)), "samples": samples})
    source = "demo" if config.dataset == "demo" else str(path)
    return Calibration(samples=samples, sha256=digest, source=f"{source} ({config.samples}×{config.seq_len} tokens)")


def _shingles(text: str, n: int) -> dict[int, int]:
    """Hash of each n-word window -> its word offset (first occurrence)."""
    words = re.findall(r"\w+", text.lower())
    out: dict[int, int] = {}
    for i in range(len(words) - n + 1):
        out.setdefault(hash(" ".join(words[i:i + n])), i)
    return out


def check_disjoint(calibration_text: Path, eval_text: Path, n: int = 13, max_fraction: float = 0.001) -> float:
    """Refuse when more than `max_fraction` of the eval text's `n`-word passages are in the calibration text.

    Thirteen-word windows almost never repeat between different documents by chance, so shared
    windows mean shared text. Returns the fraction found (0.0 for disjoint files).
    """
    cal_text, ev_text = (load_text(Path(p)) if Path(p).suffix == ".jsonl" else Path(p).read_text()
                         for p in (calibration_text, eval_text))
    cal, ev = _shingles(cal_text, n), _shingles(ev_text, n)
    shared = [ev[h] for h in ev.keys() & cal.keys()]
    fraction = len(shared) / max(len(ev), 1)
    if fraction > max_fraction:
        words = re.findall(r"\w+", ev_text.lower())
        example = " ".join(words[min(shared):min(shared) + n])
        raise BadInput(
            f"{FIELD}.dataset: calibration text {calibration_text} overlaps evaluation text {eval_text}: "
            f"{len(shared):,} of {len(ev):,} {n}-word passages of the evaluation text ({fraction:.1%}) also "
            f"appear in the calibration text, e.g. \"{example}\". Calibrating on evaluated text flatters the "
            "quantized model; use disjoint files.")
    return fraction
