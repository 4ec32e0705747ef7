"""TextStream (engine/serve/protocol.py): incremental detokenization against decoding the whole text.

The reference below is the whole-text rule TextStream replaced: decode every id each token, cut
at the first stop string, hold back a trailing incomplete character and a possible stop prefix.
The windowed stream must emit exactly the same deltas, token by token.
"""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from kiln.engine.serve.protocol import TextStream

SAMPLES = ("Emma Woodhouse, handsome, clever, and rich. ", "日本語のテキスト、", "naïve café — déjà vu ",
           "🙂🚀 emoji 👩‍👩‍👧 ", "Ελληνικά και русский ", "x = 1; y += 2\n\n\t", "  spaced   out  ")


class Reference:
    """Whole-text decode every token (the rule before the window)."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tokenizer, self.stop, self.ids, self.sent, self.stopped = tokenizer, stop, [], 0, False

    def push(self, token_id: int | None, final: bool = False) -> str:
        if token_id is not None:
            self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            text, self.stopped, final = text[: min(hits)], True, True
        safe = len(text)
        if not final:
            safe -= text.endswith("\ufffd")
            safe -= max((len(s) - 1 for s in self.stop), default=0)
        delta = text[self.sent : max(safe, self.sent)]
        self.sent += len(delta)
        return delta


class Counting:
    """The tokenizer, recording how many ids each decode call was given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.sizes = tokenizer, []
        self.all_special_ids = tokenizer.all_special_ids

    def decode(self, ids, **kwargs):
        self.sizes.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


@pytest.fixture(scope="module")
def tokenizer(demo_model):
    return AutoTokenizer.from_pretrained(demo_model)


def _sequence(rng: random.Random, tok, partial: list[int]) -> list[int]:
    """Real multi-byte text split across tokens, lone byte tokens, random ids and special tokens."""
    ids: list[int] = []
    while len(ids) < rng.randrange(1, 90):
        kind = rng.random()
        if kind < 0.5:
            ids += tok.encode(rng.choice(SAMPLES), add_special_tokens=False)[: rng.randrange(1, 12)]
        elif kind < 0.7:
            ids += rng.choices(partial, k=rng.randrange(1, 4))
        elif kind < 0.9:
            ids.append(rng.randrange(len(tok)))
        else:
            ids.append(rng.choice(tok.all_special_ids))
    return ids


def _stops(rng: random.Random, text: str) -> tuple[str, ...]:
    """Substrings of the text (some spanning tokens), sometimes one that never occurs, or none.
    None holds U+FFFD: the reference would match it against a character still incomplete."""
    stops = []
    for _ in range(rng.randrange(0, 3)):
        if len(text) > 1:
            at = rng.randrange(len(text) - 1)
            stops.append(text[at : at + rng.randrange(1, 6)])
    if rng.random() < 0.3:
        stops.append("never-in-the-text")
    return tuple(s for s in stops if s and "\ufffd" not in s)


def _run(stream, ids: list[int], flush: bool) -> list[str]:
    out = []
    for k, token in enumerate(ids):
        out.append(stream.push(token, final=not flush and k == len(ids) - 1))
        if stream.stopped:
            return out
    if flush:
        out.append(stream.push(None, final=True))
    return out


def test_windowed_deltas_equal_whole_text_decode(tokenizer):
    rng = random.Random(17)
    text = "".join(SAMPLES)
    partial = sorted({i for i in tokenizer.encode(text, add_special_tokens=False)
                      if "\ufffd" in tokenizer.decode([i])})
    assert len(partial) > 10  # byte-fallback pieces of multi-byte characters
    seen = {"stopped": 0, "held_char": 0, "moved": 0}
    for case in range(400):
        ids = _sequence(rng, tokenizer, partial)
        stops = _stops(rng, tokenizer.decode(ids, skip_special_tokens=True))
        flush = rng.random() < 0.3
        ref, got = Reference(tokenizer, stops), TextStream(tokenizer, stops)
        expected, actual = _run(ref, ids, flush), _run(got, ids, flush)
        assert actual == expected, (case, ids, stops)
        assert got.stopped == ref.stopped
        seen["stopped"] += got.stopped
        seen["moved"] += got._start > 0
        seen["held_char"] += any(tokenizer.decode(ids[: k + 1]).endswith("\ufffd") for k in range(len(ids)))
    assert min(seen.values()) > 20, seen  # every path above was exercised, not only the easy one


def test_each_token_decodes_a_short_window(tokenizer):
    ids = tokenizer.encode(SAMPLES[0] * 40, add_special_tokens=False)[:300]
    counting = Counting(tokenizer)
    stream = TextStream(counting, ("</end>",))
    text = "".join(stream.push(t) for t in ids) + stream.push(None, final=True)
    assert text == tokenizer.decode(ids)
    assert max(counting.sizes) <= TextStream.WINDOW + 2
    assert len(counting.sizes) < 1.2 * len(ids)
