"""The demo's copy-heavy prompt set (`evaluate.benchmark.prompts: demo-copy`): rewrite a passage of the
held-out Austen text, fixing its typos.

A model that does this well copies long spans of its prompt, the traffic shape where speculative
decoding by n-gram lookup pays (a draft found in the prompt is accepted token after token); GSM8K
questions ('demo') are the shape where it does not. Each prompt is a passage with a few seeded typos
(two adjacent inner letters of a word swapped) in a completion-style frame, since the benchmark sends
a prompt's text as it is, without a chat template: the frame's last line invites the copy.
"""

from __future__ import annotations

import random
import re
from typing import Any

PROMPTS_SPEC = "demo-copy"  # the recipe's name for this set (evaluate.benchmark.prompts)
COPY_ITEMS, COPY_SEED, COPY_MIN_WORDS, COPY_MAX_WORDS, COPY_TYPOS = 64, 20261207, 50, 90, 3
FRAME = "Rewrite this passage, fixing its typos:\n\n{passage}\n\nThe passage with its typos fixed:\n\n"
_TYPO_WORD = re.compile(r"[a-z]{5,}")  # long plain words: a swap inside one reads as a typo, not a new word


def copy_prompts(paras: list[str], n: int = COPY_ITEMS, seed: int = COPY_SEED) -> list[dict[str, Any]]:
    """`n` seeded prompts from paragraphs of COPY_MIN_WORDS-COPY_MAX_WORDS words (no _italics_ marks),
    each with the passage it was made from."""
    rng = random.Random(seed)
    pool = [p for p in paras if COPY_MIN_WORDS <= len(p.split()) <= COPY_MAX_WORDS and "_" not in p]
    if len(pool) < n:
        raise RuntimeError(f"only {len(pool)} paragraphs of {COPY_MIN_WORDS}-{COPY_MAX_WORDS} words for {n} prompts")
    return [{"id": f"copy-{i:03d}", "prompt": FRAME.format(passage=with_typos(p, rng)), "passage": p}
            for i, p in enumerate(rng.sample(pool, n))]


def with_typos(passage: str, rng: random.Random, typos: int = COPY_TYPOS) -> str:
    """`passage` with `typos` of its long plain words each given two adjacent inner letters swapped
    (first and last letters kept: 'daughter' -> 'daughetr'); words read as words otherwise."""
    words = passage.split()
    spots = [i for i, w in enumerate(words) if _TYPO_WORD.fullmatch(w)]
    for i in sorted(rng.sample(spots, min(typos, len(spots)))):
        w = words[i]
        j = rng.randrange(1, len(w) - 2)
        if w[j] == w[j + 1]:  # a double letter swapped is no typo: the next pair instead
            j = j + 1 if j + 2 < len(w) - 1 else j - 1
        words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)
