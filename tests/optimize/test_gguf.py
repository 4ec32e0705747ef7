"""The `gguf` method on the tiny Llama: conversion, llama-quantize types, manifests read from the
file, and the tokenizer check (llama.cpp's tokenization against the HF tokenizer's)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kiln.optimize.checkpoint import param_count
from kiln.optimize.gguf import Gguf, GgufConfig, check_tokenizer, describe
from kiln.core.errors import BadInput
from tests.llama_cpp_build import require_llama_cpp


@pytest.fixture(scope="module", autouse=True)
def _built():
    require_llama_cpp()


@pytest.fixture(scope="module")
def f32_artifact(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf-f32")
    fields = Gguf(GgufConfig(type="f32")).quantize(tiny_model_dir, out, None)
    return out, fields


def test_f32_manifest_from_the_file(f32_artifact, tiny_model_dir):
    out, fields = f32_artifact
    assert (out / "model.gguf").is_file() and (out / "tokenizer.json").is_file()
    assert fields["type"] == "f32" and fields["bits_per_weight"] == 32.0
    assert fields["tensor_types"] == {"F32": fields["tensor_types"]["F32"]}
    assert fields["tensors_not_at_type"] == {}
    assert fields["params"] == param_count(tiny_model_dir)
    # The byte-level BPE vocabulary, checked against the HF tokenizer on the sample text.
    assert fields["tokenizer_model"] == "gpt2"
    assert fields["tokenizer_check"]["identical"] and fields["tokenizer_check"]["tokens"] > 100


def test_unfixed_tokenizer_converts_to_spm_and_is_refused(tiny_model_dir, tmp_path):
    """The converter run on the checkpoint as it is writes an SPM ('llama') vocabulary for the
    demo's byte-level BPE tokenizer.json (it has byte_fallback and an SPM-style decoder); the
    tokenizer check refuses that file."""
    from kiln.core.llama_cpp_build import converter

    target = tmp_path / "raw.gguf"
    subprocess.run([sys.executable, str(converter()), str(tiny_model_dir), "--outfile", str(target),
                    "--outtype", "f32"], check=True, capture_output=True)
    assert describe(target)["tokenizer_model"] == "llama"
    with pytest.raises(BadInput, match="'llama'"):
        check_tokenizer(target, tiny_model_dir, ["The quick brown fox jumps over the lazy dog."])


@pytest.mark.parametrize(("kind", "main", "low", "high"),
                         [("q8_0", "Q8_0", 8.0, 9.5), ("q4_1", "Q4_1", 5.0, 9.0), ("q5_0", "Q5_0", 5.5, 9.0),
                          ("iq4_nl", "IQ4_NL", 4.5, 9.0), ("q4_K_M", "Q4_K", 4.0, 9.0), ("q6_K", "Q6_K", 6.0, 9.0)])
def test_quantized_types(f32_artifact, tiny_model_dir, tmp_path, kind, main, low, high):
    fields = Gguf(GgufConfig(type=kind, threads=1)).quantize(tiny_model_dir, tmp_path, None)
    assert low <= fields["bits_per_weight"] <= high
    assert fields["file_bytes"] < 0.5 * f32_artifact[1]["file_bytes"]
    assert fields["tokenizer_model"] == "gpt2" and fields["tokenizer_check"]["identical"]
    if kind == "q8_0":
        assert fields["tensors_not_at_type"] == {}
    elif kind in ("q4_1", "q5_0", "iq4_nl"):
        # every matrix row is a whole number of 32-wide blocks; llama-quantize keeps only the token
        # embedding (the output matrix too, when it is its own tensor) at a higher type
        assert fields["tensor_types"][main] > 0
        assert set(fields["tensors_not_at_type"]) <= {"token_embd.weight", "output.weight"}
    else:
        # hidden 128 is not a multiple of the 256-wide k-quant block: every matrix falls back,
        # and the manifest names each with the type it got.
        assert fields["tensors_not_at_type"]
        assert main not in fields["tensors_not_at_type"].values()


def test_needs_safetensors(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(BadInput):
        Gguf(GgufConfig(type="f32")).quantize(tmp_path, tmp_path / "out", None)


@pytest.mark.parametrize("kind", ["q8_0", "q4_K_M"])
def test_a_bf16_checkpoint_quantizes_through_a_bf16_file_to_the_same_bytes(tiny_model_dir, tmp_path, kind, monkeypatch):
    """llama-quantize reads a full-precision GGUF first: for a bf16 checkpoint kiln writes it in bf16, not
    f32 (widening is exact, and an 8B checkpoint's f32 file is 32 GB of disk); the quantized file is
    byte for byte the one the f32 route writes (and the same checkpoint always converts to the same
    bytes: the model's name in the file is the checkpoint folder's, not a temporary one's)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kiln.optimize import gguf

    bf16 = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(bf16)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(bf16)
    assert gguf._lossless_outtype(bf16) == "bf16" and gguf._lossless_outtype(tiny_model_dir) == "f32"
    seen = []
    convert = gguf.convert
    monkeypatch.setattr(gguf, "convert", lambda s, t, outtype: (seen.append(outtype), convert(s, t, outtype)))
    Gguf(GgufConfig(type=kind, threads=1)).quantize(bf16, tmp_path / "via-bf16", None)
    monkeypatch.setattr(gguf, "_lossless_outtype", lambda source: "f32")
    Gguf(GgufConfig(type=kind, threads=1)).quantize(bf16, tmp_path / "via-f32", None)
    assert seen == ["bf16", "f32"]
    assert (tmp_path / "via-bf16" / "model.gguf").read_bytes() == (tmp_path / "via-f32" / "model.gguf").read_bytes()


@pytest.mark.parametrize("kind", ["q8_0", "q4_K_M", "iq4_nl"])
def test_the_c_api_quantizes_to_the_bytes_llama_quantize_writes(f32_artifact, tmp_path, kind):
    """kiln quantizes through llama.cpp's C API (so `make demo` need not compile the `common` library the
    llama-quantize program links); the program, built with the rest of llama.cpp, writes the same file."""
    from kiln.core.llama_cpp_build import binary
    from kiln.optimize.gguf import QUANT_TYPES, quantize_file

    src = f32_artifact[0] / "model.gguf"
    quantize_file(src, tmp_path / "api.gguf", kind, threads=1)
    subprocess.run([str(binary("llama-quantize")), str(src), str(tmp_path / "cli.gguf"), QUANT_TYPES[kind][0], "1"],
                   check=True, capture_output=True)
    assert (tmp_path / "api.gguf").read_bytes() == (tmp_path / "cli.gguf").read_bytes()


def test_llama_cpp_s_tokenizer_takes_every_text_in_one_load_as_given(f32_artifact, tiny_model_dir):
    """The tokenizer check's ids come from llama.cpp's own tokenizer, texts as given (a backslash-n stays
    two characters: llama-tokenize would have turned it into a newline first)."""
    from transformers import AutoTokenizer

    from kiln.optimize.gguf import llama_tokenize

    texts = ["plain text", "a literal \\n escape", "", "naïve café"]
    hf = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert llama_tokenize(f32_artifact[0] / "model.gguf", texts) == [
        hf(t, add_special_tokens=False).input_ids for t in texts]
