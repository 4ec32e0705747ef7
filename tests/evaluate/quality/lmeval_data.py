"""Small stand-ins for kiln's demo data (same file formats as kiln.pipeline.demo.data writes)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

WORDS = "the quick brown fox jumps over a lazy dog while seven bright stars shine above quiet hills".split()


def sentence(i: int, n: int = 12) -> str:
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(n)).capitalize() + "."


def write_data(root: Path, swaps: int = 10, repeat_first: int = 0) -> SimpleNamespace:
    """Held-out text, word-swap items and GSM8K-style answers, small enough for a tiny model.

    `repeat_first` appends identical copies of the first word-swap item: lm-eval gives the copies
    the same doc_hash, so only doc_id keeps them apart.
    """
    root.mkdir(parents=True, exist_ok=True)
    paras = [" ".join(sentence(i + k) for k in range(6)) for i in range(30)]
    (root / "eval.txt").write_text("Title\n\n" + "\n\n".join(paras) + "\n")
    items = []
    for i in range(swaps):
        words = sentence(i).split()
        words[3], words[4] = words[4], words[3]
        label = i % 2
        pair = [sentence(i), " ".join(words)]
        items.append({"id": f"swap-{i:03d}", "choices": pair if label == 0 else pair[::-1], "label": label})
    items += [dict(items[0]) for _ in range(repeat_first)]
    (root / "word_swap.jsonl").write_text("".join(json.dumps(x) + "\n" for x in items))
    answers = [{"id": f"gsm8k-{i:04d}", "context": f"Question: {sentence(i, 8)}\nAnswer:",
                "continuation": f" {sentence(i + 1, 6)}\n#### {i}"} for i in range(12)]
    (root / "gsm8k_answers.jsonl").write_text("".join(json.dumps(x) + "\n" for x in answers))
    return SimpleNamespace(eval_text=root / "eval.txt", word_swap=root / "word_swap.jsonl",
                           gsm8k_answers=root / "gsm8k_answers.jsonl")
