"""The copy-heavy prompt set (`evaluate.benchmark.prompts: demo-copy`): seeded passages of the held-out
text, each with exactly its few typos, in the frame the benchmark sends as it is."""

from __future__ import annotations

import json
import random

from kiln.pipeline.demo.copy_prompts import COPY_ITEMS, COPY_TYPOS, FRAME, copy_prompts, with_typos


def test_every_prompt_is_its_passage_with_a_few_swapped_letters(demo_data):
    rows = [json.loads(line) for line in demo_data.copy_prompts.read_text().splitlines()]
    assert len(rows) == COPY_ITEMS and len({r["id"] for r in rows}) == COPY_ITEMS
    head, tail = FRAME.split("{passage}")
    eval_text = demo_data.eval_text.read_text()
    for r in rows:
        assert r["prompt"].startswith(head) and r["prompt"].endswith(tail) and r["passage"] in eval_text
        typed, clean = r["prompt"][len(head):-len(tail)].split(), r["passage"].split()
        changed = [(a, b) for a, b in zip(typed, clean) if a != b]
        assert len(typed) == len(clean) and len(changed) == COPY_TYPOS, r["id"]
        for a, b in changed:  # two adjacent inner letters swapped, first and last kept
            j = next(i for i in range(len(a)) if a[i] != b[i])
            assert 0 < j < len(b) - 2 and a == b[:j] + b[j + 1] + b[j] + b[j + 2:], (a, b)


def test_the_set_is_seeded():
    paras = [" ".join(f"word{i}x alphabet{i} letters" for i in range(20)) + f" end{k}." for k in range(8)]
    assert copy_prompts(paras, 4, 1) == copy_prompts(paras, 4, 1) != copy_prompts(paras, 4, 2)
    assert with_typos("aaaaa bbbbb", random.Random(0), 2) == "aaaaa bbbbb"  # a swap of like letters changes nothing
