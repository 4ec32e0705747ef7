"""The llama_cpp engine's levers (issue 53): speculative decoding, KV-cache types for K and V and
prompt-cache reuse reach the engine that runs them, read back from the other side rather than from
the command kiln wrote: a running llama-server's `/slots` (the speculative type it runs), its own
log (the KV cache types: `/props` does not report them) and its timings (`cache_n`: prompt tokens it
served from its cache); the library runtime's and the scorer's llama.cpp context through the binding
(the bytes a sequence's KV cache takes). Bad combinations fail validation naming the field."""

from __future__ import annotations

import json
import subprocess
import tempfile
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from kiln.engine.llama_cpp.config import LlamaCppConfig, SpeculativeConfig
from kiln.engine.llama_cpp.server import LlamaServerEngine, server_command
from kiln.pipeline.recipe.schema import Recipe, format_errors

EXACT = {"cache_type": "f32", "flash_attn": "off", "threads": 1, "ctx_per_slot": 512}
# What a llama_cpp engine config dumped to before the levers existed: every engine stage key and
# recipe digest is made from this dump, so a lever left at its default must not appear in it.
DUMPED_BEFORE = {"backend", "precision", "runtime", "threads", "parallel", "ctx_per_slot", "batch_size",
                 "cache_type", "flash_attn", "startup_timeout_s"}


# ----- config: defaults, validation, the command -------------------------------------------------

def test_levers_at_their_defaults_leave_the_dump_and_digest_as_they_were():
    assert set(LlamaCppConfig().model_dump(mode="json")) == DUMPED_BEFORE
    explicit = LlamaCppConfig(cache_type_k=None, cache_type_v=None, speculative=None, cache_reuse=0)
    assert explicit.model_dump(mode="json") == LlamaCppConfig().model_dump(mode="json")
    set_k = LlamaCppConfig(cache_type_k="q8_0").model_dump(mode="json")
    assert set(set_k) == DUMPED_BEFORE | {"cache_type_k"}
    plain = _recipe({"backend": "llama_cpp", "threads": 2})
    assert plain.digest() == _recipe({"backend": "llama_cpp", "threads": 2, "cache_reuse": 0,
                                      "speculative": None}).digest()
    assert plain.digest() != _recipe({"backend": "llama_cpp", "threads": 2, "cache_reuse": 64}).digest()


def _recipe(engine: dict) -> Recipe:
    return Recipe.model_validate({"name": "x", "optimize": {"method": "gguf", "type": "q8_0"}, "engine": engine,
                                  "gate": {"checks": [{"kind": "size", "max_ratio": 1}]}})


@pytest.mark.parametrize(("engine", "path", "words"), [
    ({"runtime": "library", "speculative": {"type": "ngram-simple"}}, "engine", "speculative: speculative decoding "
     "runs in llama-server only"),
    ({"runtime": "library", "cache_reuse": 256}, "engine", "cache_reuse: prompt-cache reuse is llama-server's"),
    ({"cache_type_v": "q8_0", "flash_attn": "off"}, "engine", "cache_type_v: a quantized V cache (q8_0"),
    ({"cache_type": "q4_0", "flash_attn": "off"}, "engine", "cache_type_v: a quantized V cache (q4_0"),
    ({"speculative": {"type": "draft", "draft_model": "nowhere/draft.gguf"}}, "engine.speculative",
     "draft_model 'nowhere/draft.gguf' is not an existing .gguf file"),
    ({"speculative": {"type": "draft"}}, "engine.speculative", "type draft needs draft_model"),
    ({"speculative": {"type": "draft", "draft_model": "d.gguf", "ngram_n": 3}}, "engine.speculative",
     "ngram_n and ngram_m size the n-gram types"),
    ({"speculative": {"type": "ngram-simple", "draft_max": 8}}, "engine.speculative",
     "draft_model and draft_max belong to type draft"),
    ({"speculative": {"type": "ngram-cache", "ngram_m": 8}}, "engine.speculative", "ngram-cache has fixed sizes"),
    ({"speculative": {"type": "ngram-mod", "ngram_m": 16}}, "engine.speculative", "set draft_min to at most 16"),
    ({"speculative": {"type": "ngram-simpel"}}, "engine.speculative.type", "Input should be"),
    ({"cache_type_k": "q9_0"}, "engine.cache_type_k", "Input should be"),
])
def test_a_lever_that_cannot_run_is_refused_naming_its_field(engine, path, words):
    raw = {"name": "x", "optimize": {"method": "gguf", "type": "q8_0"}, "engine": {"backend": "llama_cpp", **engine},
           "gate": {"checks": [{"kind": "size", "max_ratio": 1}]}}
    with pytest.raises(ValidationError) as e:
        Recipe.model_validate(raw)
    lines = format_errors(e.value, raw)
    assert any(line.startswith(f"{path}:") and words in line for line in lines), lines


def test_a_draft_model_must_be_a_gguf_file(tmp_path):
    (tmp_path / "d.gguf").write_bytes(b"GGUF")
    (tmp_path / "d.bin").write_bytes(b"GGUF")
    assert SpeculativeConfig(type="draft", draft_model=str(tmp_path / "d.gguf")).draft_model
    with pytest.raises(ValidationError, match="is not an existing .gguf file"):
        SpeculativeConfig(type="draft", draft_model=str(tmp_path / "d.bin"))


def test_plain_twin_drops_speculation_only():
    spec = LlamaCppConfig(threads=2, cache_type_k="q8_0", speculative={"type": "ngram-simple", "ngram_n": 3})
    twin = spec.plain_twin()
    assert twin is not None and twin.speculative is None
    # The twin dumps as the same engine written without speculation: the same engine stage key.
    assert twin.model_dump() == LlamaCppConfig(threads=2, cache_type_k="q8_0").model_dump()
    assert {**twin.model_dump(), "speculative": spec.speculative.model_dump()} == spec.model_dump()
    assert LlamaCppConfig(cache_type_k="q8_0").plain_twin() is None


def _flags(cmd: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(cmd, cmd[1:], strict=False) if a.startswith("--") and not b.startswith("--")}


def test_server_command_names_each_lever(tmp_path):
    draft = tmp_path / "draft.gguf"
    draft.write_bytes(b"GGUF")
    cmd = _flags(server_command("llama-server", "m.gguf", 1, LlamaCppConfig(threads=3)))
    assert cmd["--cache-type-k"] == cmd["--cache-type-v"] == "f16"
    assert not {"--spec-type", "--cache-reuse"} & set(cmd)
    cases = [
        ({"cache_type": "f32", "cache_type_k": "q8_0", "cache_reuse": 64},
         {"--cache-type-k": "q8_0", "--cache-type-v": "f32", "--cache-reuse": "64"}),
        ({"speculative": {"type": "ngram-simple", "ngram_n": 3, "ngram_m": 8}},
         {"--spec-type": "ngram-simple", "--spec-ngram-simple-size-n": "3", "--spec-ngram-simple-size-m": "8"}),
        ({"speculative": {"type": "ngram-map-k", "ngram_n": 4}},
         {"--spec-type": "ngram-map-k", "--spec-ngram-map-k-size-n": "4"}),
        ({"speculative": {"type": "ngram-mod", "ngram_n": 16, "ngram_m": 24, "draft_min": 2}},
         {"--spec-type": "ngram-mod", "--spec-ngram-mod-n-match": "16", "--spec-ngram-mod-n-max": "24",
          "--spec-ngram-mod-n-min": "2"}),
        ({"speculative": {"type": "ngram-cache"}}, {"--spec-type": "ngram-cache"}),
        ({"speculative": {"type": "draft", "draft_model": str(draft), "draft_max": 6, "draft_min": 1}},
         {"--spec-type": "draft-simple", "--spec-draft-model": str(draft), "--spec-draft-n-max": "6",
          "--spec-draft-n-min": "1", "--spec-draft-threads": "3", "--spec-draft-threads-batch": "3"}),
    ]
    for options, want in cases:
        got = _flags(server_command("llama-server", "m.gguf", 1, LlamaCppConfig(threads=3, **options)))
        assert {k: got.get(k) for k in want} == want, options
        assert not any(k.startswith("--spec-") for k in set(got) - set(want)), got  # llama.cpp's defaults otherwise


# ----- llama-server: the levers reach the running server ---------------------------------------

def _server(folder: Path, **options) -> LlamaServerEngine:
    return LlamaServerEngine.start(folder / "model.gguf", folder, LlamaCppConfig(**EXACT, **options))


def _get(engine: LlamaServerEngine, path: str):
    with urllib.request.urlopen(engine.server_url + path, timeout=30) as r:
        return json.loads(r.read())


def _complete(engine: LlamaServerEngine, prompt: list[int], n: int) -> dict:
    """One greedy, unstreamed /completion: its tokens and llama-server's timings."""
    body = {"prompt": prompt, "n_predict": n, "return_tokens": True, "samplers": ["top_k"], "top_k": 1,
            "cache_prompt": True}
    request = urllib.request.Request(engine.server_url + "/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())


def _prompt(vocab: int) -> list[int]:
    return list(map(int, np.random.default_rng(3).integers(3, vocab, 48)))


# The tiny random Llama answers this prompt with one token over and over. ngram-simple drafts the tokens
# that followed the last match of its lookup n-gram, and only when at least n follow it: in a run of
# one token the nearest match leaves one, so it drafts with n = 1 here (the demo's text needs no such care).
@pytest.mark.parametrize("spec", [{"type": "ngram-simple", "ngram_n": 1, "ngram_m": 4}, {"type": "draft"}],
                         ids=["ngram-simple", "draft"])
def test_a_speculative_server_runs_its_type_and_answers_as_its_plain_twin(tiny_gguf, spec):
    """The server says it speculates (`/slots`: speculative, and the request's speculative.types), drafts
    tokens (timings.draft_n), and its greedy tokens are its plain twin's. Type draft drafts with the same
    GGUF, so every drafted token is the model's own argmax and is accepted."""
    if spec["type"] == "draft":
        spec = {**spec, "draft_model": str(tiny_gguf / "model.gguf"), "draft_max": 4}
    engine = _server(tiny_gguf, parallel=1, speculative=spec)
    try:
        prompt = _prompt(engine.vocab_size)
        got = _complete(engine, prompt, 48)
        slot = _get(engine, "/slots")[0]
        plain = engine.config.plain_twin()
    finally:
        engine.close()
    kind = "draft-simple" if spec["type"] == "draft" else spec["type"]
    assert slot["speculative"] is True and kind in slot["params"]["speculative.types"].split(","), slot
    assert got["timings"]["draft_n"] > 0, got["timings"]
    if spec["type"] == "draft":
        assert got["timings"]["draft_n_accepted"] == got["timings"]["draft_n"], got["timings"]
    twin = LlamaServerEngine.start(tiny_gguf / "model.gguf", tiny_gguf, plain)
    try:
        want = _complete(twin, prompt, 48)
        assert _get(twin, "/slots")[0]["speculative"] is False
    finally:
        twin.close()
    assert got["tokens"] == want["tokens"]


def test_kv_cache_types_and_speculative_sizes_reach_llama_server(tiny_gguf):
    """llama-server's `/props` and `/slots` report neither its KV cache types nor its n-gram sizes; its own
    log at load does, at verbosity 4 (`llama_kv_cache: ... K (q8_0): ... MiB, V (f16): ...` and the
    speculative implementation's `- size_n=2, size_m=5`). The server runs kiln's command with its
    --log-disable swapped for that verbosity."""
    config = LlamaCppConfig(threads=1, ctx_per_slot=256, parallel=1, cache_type_k="q8_0", cache_type_v="f16",
                            speculative={"type": "ngram-map-k", "ngram_n": 2, "ngram_m": 5})
    from kiln.core.llama_cpp_build import binary
    from kiln.engine.remote import free_port, stop_process, wait_healthy

    port = free_port()
    cmd = [a for a in server_command(binary("llama-server"), tiny_gguf / "model.gguf", port, config)
           if a != "--log-disable"] + ["--log-verbosity", "4"]
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", 60, process, "llama-server", log)
        finally:
            stop_process(process, 30)
        log.seek(0)
        text = log.read().decode(errors="replace")
    kv = [line for line in text.splitlines() if "llama_kv_cache" in line and "K (" in line]
    assert kv and "K (q8_0)" in kv[0] and "V (f16)" in kv[0], kv or text[-2000:]
    assert "adding speculative implementation 'ngram-map-k'" in text and "size_key=2, size_value=5" in text, \
        [line for line in text.splitlines() if "spec" in line] or text[-2000:]


def test_cache_reuse_serves_a_shifted_chunk_from_the_cache(tiny_gguf):
    """A prompt that drops a piece from the middle of an earlier one shares only the part before it as a
    prefix: llama-server serves that part from its cache (timings.cache_n, prompt tokens it did not
    evaluate) and evaluates the rest, unless --cache-reuse lets it shift the cached chunk after the
    dropped piece into place. (llama-server's reuse skips cached tokens, never new ones: a piece inserted
    into the new prompt stops it.)"""
    body = list(map(int, np.random.default_rng(7).integers(3, 1000, 64)))
    cached = {}
    for reuse in (0, 16):
        engine = _server(tiny_gguf, parallel=1, cache_reuse=reuse)
        try:
            _complete(engine, [*body[:16], 5, 6, 7, 8, *body[16:]], 1)
            cached[reuse] = _complete(engine, body, 1)["timings"]["cache_n"]
        finally:
            engine.close()
    assert cached == {0: 16, 16: len(body) - 1}, cached  # the last prompt token is always evaluated


# ----- in-process: the library runtime's and the scorer's llama.cpp context ------------------

def _kv_bytes(context, seq: int = 0) -> int:
    """Bytes of one sequence's KV cache as llama.cpp would save it (its state: the cells' K and V rows)."""
    from kiln.engine.llama_cpp.binding import binding

    return int(binding().llama_cpp.llama_state_seq_get_size(context.ctx, seq))


def test_kv_cache_types_reach_the_library_runtime_and_the_scorer(tiny_gguf):
    """A q8_0 K cache stores 34 bytes per 32 values against f16's 64: with V at f16, a sequence's KV
    takes (34/32 + 2) / 4 = 0.77 of an all-f16 one, in the library runtime's generation context (read
    mid-generation) and in the scorer's (read after scoring)."""
    from kiln.engine.llama_cpp.library import LlamaLibraryEngine
    from kiln.engine.base import GenerationRequest

    sizes = {}
    for k in ("f16", "q8_0"):
        config = LlamaCppConfig(runtime="library", threads=1, parallel=1, ctx_per_slot=256, cache_type="f16",
                                cache_type_k=k)
        engine = LlamaLibraryEngine(tiny_gguf / "model.gguf", tiny_gguf, config)
        try:
            engine.add(GenerationRequest(list(range(3, 40)), 8, ignore_eos=True))
            for _ in range(3):
                engine.step()
            generating = _kv_bytes(engine.context)
            engine.score([(list(range(3, 40)), [41, 42])])
            sizes[k] = (generating, _kv_bytes(engine.scorer.context))
        finally:
            engine.close()
    for where in (0, 1):
        assert 0.72 < sizes["q8_0"][where] / sizes["f16"][where] < 0.82, sizes
