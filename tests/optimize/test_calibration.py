"""Calibration sets: token chunks, a hash that follows the data, and the overlap refusal."""

from __future__ import annotations

import json

import pytest

from kiln.optimize.calibration import CalibrationConfig, build_calibration, check_disjoint
from kiln.core.errors import BadInput


def _write(path, text):
    path.write_text(text)
    return path


def test_samples_are_chunks_of_seq_len(tiny_llama, tmp_path, make_corpus):
    corpus = make_corpus
    from transformers import AutoTokenizer

    text = _write(tmp_path / "c.txt", corpus(300))
    cal = build_calibration(CalibrationConfig(dataset=str(text), samples=5, seq_len=32, seed=3), tiny_llama)
    assert len(cal.samples) == 5 and all(len(s) == 32 for s in cal.samples)
    assert len({tuple(s) for s in cal.samples}) == 5
    # The chunks are the file's own tokens, in order.
    stream = AutoTokenizer.from_pretrained(str(tiny_llama))("\n".join(corpus(300).splitlines()),
                                                           add_special_tokens=False)["input_ids"]
    first = cal.samples[0]
    assert any(stream[i:i + 32] == first for i in range(0, len(stream) - 31, 32))
    assert str(text) in cal.source and "5×32" in cal.source


def test_hash_follows_text_seed_and_is_stable(tiny_llama, tmp_path, make_corpus):
    corpus = make_corpus
    a = _write(tmp_path / "a.txt", corpus(300))
    b = _write(tmp_path / "b.txt", corpus(300).replace("lazy", "sleepy"))

    def digest(path, seed=0):
        return build_calibration(CalibrationConfig(dataset=str(path), samples=4, seq_len=32, seed=seed),
                                 tiny_llama).sha256

    assert digest(a) == digest(a)
    assert digest(a) != digest(b)
    assert digest(a) != digest(a, seed=1)


def test_jsonl_text_field(tiny_llama, tmp_path, make_corpus):
    corpus = make_corpus
    rows = tmp_path / "c.jsonl"
    lines = corpus(300).splitlines()
    rows.write_text("".join(json.dumps({"text": line, "id": i}) + "\n" for i, line in enumerate(lines)))
    txt = _write(tmp_path / "c.txt", corpus(300))
    cfg = dict(samples=4, seq_len=32)
    from_jsonl = build_calibration(CalibrationConfig(dataset=str(rows), **cfg), tiny_llama)
    from_txt = build_calibration(CalibrationConfig(dataset=str(txt), **cfg), tiny_llama)
    assert from_jsonl.samples == from_txt.samples

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"body": "no text field"}) + "\n")
    with pytest.raises(BadInput, match="has no 'text' field"):
        build_calibration(CalibrationConfig(dataset=str(bad), **cfg), tiny_llama)


def test_bad_dataset_paths_and_sizes(tiny_llama, tmp_path):
    with pytest.raises(BadInput, match=r"optimize.calibration.dataset: .*missing.txt is not a file"):
        build_calibration(CalibrationConfig(dataset=str(tmp_path / "missing.txt")), tiny_llama)
    csv = _write(tmp_path / "c.csv", "a,b\n")
    with pytest.raises(BadInput, match="expected .txt"):
        build_calibration(CalibrationConfig(dataset=str(csv)), tiny_llama)
    short = _write(tmp_path / "short.txt", "only a few words here")
    with pytest.raises(BadInput, match=r"optimize.calibration.samples: 64 samples of 256 tokens need"):
        build_calibration(CalibrationConfig(dataset=str(short)), tiny_llama)


def test_config_forbids_typos():
    with pytest.raises(ValueError, match="sample"):
        CalibrationConfig(sample=3)


def test_overlap_is_refused_naming_both_files(tmp_path):
    novel = " ".join(f"word{i} lorem{i % 7} ipsum{i % 11}" for i in range(3000))
    cal = _write(tmp_path / "calibration.txt", novel)
    ev = _write(tmp_path / "eval.txt", "completely different text " * 5 + novel[:4000])
    with pytest.raises(BadInput) as e:
        check_disjoint(cal, ev)
    msg = str(e.value)
    assert str(cal) in msg and str(ev) in msg and "13-word passages" in msg


def test_disjoint_texts_pass(tmp_path):
    cal = _write(tmp_path / "calibration.txt", " ".join(f"alpha{i} beta{i % 5}" for i in range(5000)))
    ev = _write(tmp_path / "eval.txt", " ".join(f"gamma{i} delta{i % 5}" for i in range(5000)))
    assert check_disjoint(cal, ev) == 0.0
