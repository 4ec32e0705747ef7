"""kiln at the sizes its users run (issue 35): 135M, 1B, 3B and 8B checkpoints through one search.

For each size, a random-weight checkpoint built from the published configuration (no download:
the dicts below are the config.json values of Llama-3.2-1B, Qwen2.5-3B and Llama-3.1-8B), in bf16,
sharded into 1 GiB safetensors files with a `model.safetensors.index.json`, with the demo model's
tokenizer (its bos/eos/pad ids replace the published ones; the published vocab size is kept, so
the embedding is the published size and rows past the tokenizer's 49,152 are never read). Weights
are generated one shard at a time, so the generator holds at most one shard (1 GiB) and one
tensor. 135M is the demo checkpoint itself (fp32, as kiln publishes it).

Each size then runs through a search recipe this script writes: GGUF q8_0 and q4_K_M on llama.cpp
(runtime: library) and OpenVINO int8, against the checkpoint as published (torch at its own dtype:
bf16 for the three built ones). Small evaluate settings (24 perplexity documents of 64 tokens,
4 prompts x 2 rounds of 16-token decodes) and a gate of perplexity (+5%) and speed (>= 1x): random
weights say nothing about quality, so these runs measure memory, time and speed only. From the
run's stage manifests: wall time and peak memory per stage (kiln's own VmHWM and its children's
summed PSS), whether a stage exceeded 1.3 x the weight bytes it holds + 1 GiB; decode tok/s at batch
1 per arm (the benchmark stage, prompt excluded), `llama-bench` tg64 of the q8_0 and q4_K_M GGUFs
(bench/llama_cpp_runtimes.py's code) and MBU against the measured copy bandwidth; the search's pick
and kiln's q8_0 engine driven directly, each between two `llama-bench` q8_0 runs (`--framed-rounds`,
`framed_pick`: the benchmark stage and `llama-bench` run minutes apart, and this machine's speed
moves by up to 40% between moments); and `kiln plan-memory`'s prediction for each stage beside the
measured peak.

    flock /tmp/kiln-heavy.lock .venv/bin/python bench/scale.py --size 1b          # build, plan, run
    .venv/bin/python bench/scale.py --size 8b --plan-only --available 20G         # build + plan only
    .venv/bin/python bench/scale.py --table                                       # the table of every size run

Writes bench/results/scale-<size>.json (one per size, so each size is one run under the lock) and
prints the table of every scale-*.json. kiln runs from `--workdir` (outside the project: its
mlflow.db and runs/ go there) with the default cache, as a user's run would.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import llama_cpp_runtimes

from kiln.evaluate import contention

RESULTS = Path(__file__).parent / "results"
SHARD_BYTES = 1 << 30
GIB = 1 << 30

# The published config.json of each model (Hugging Face hub, as of 2026), every field that shapes
# the weights or the rotary embedding; torch_dtype is what the checkpoints ship in.
LLAMA_32_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "attention_dropout": 0.0,
    "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": False, "num_attention_heads": 32, "num_hidden_layers": 16,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256,
}
QWEN_25_3B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 32768,
    "max_window_layers": 36, "num_attention_heads": 16, "num_hidden_layers": 36, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "use_cache": True, "use_mrope": False, "use_sliding_window": False,
    "vocab_size": 151936,
}
LLAMA_32_3B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "attention_dropout": 0.0,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 3072, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": False, "num_attention_heads": 24, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256,
}
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "attention_dropout": 0.0,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 131072, "mlp_bias": False, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256,
}
SIZES = {"135m": ("SmolLM2-135M-Instruct (the demo checkpoint)", None),
         "1b": ("Llama-3.2-1B", LLAMA_32_1B), "3b": ("Llama-3.2-3B", LLAMA_32_3B),
         "3b-qwen": ("Qwen2.5-3B", QWEN_25_3B), "8b": ("Llama-3.1-8B", LLAMA_31_8B)}
# How long `kiln run` may take at each size before the bench stops it (--timeout-s overrides): about twice a
# first run with every stage computed on the 2-core machine (135M 227 s, 1B 554 s, 3B 1434 s at 100 documents).
TIMEOUT_S = {"135m": 900, "1b": 1800, "3b": 3600, "3b-qwen": 3600, "8b": 7200}
# 3b-qwen does not convert with the demo tokenizer: under the qwen2 architecture llama.cpp's converter takes
# the GPT-2 vocabulary path, whose pre-tokenizer check does not recognise it ("BPE pre-tokenizer was not
# recognized"); a real Qwen2.5 checkpoint brings its own, which it does. So 3B is measured on Llama-3.2-3B's
# shape (which kiln's OpenVINO export also supports: it traces Llama only).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
CANDIDATES = [
    {"name": "llama-q8_0", "optimize": {"method": "gguf", "type": "q8_0"},
     "engine": {"backend": "llama_cpp", "runtime": "library", "threads": 2}},
    {"name": "llama-q4_K_M", "optimize": {"method": "gguf", "type": "q4_K_M"},
     "engine": {"backend": "llama_cpp", "runtime": "library", "threads": 2}},
    {"name": "openvino-int8", "optimize": {"method": "none"},
     "engine": {"backend": "openvino", "weights": "int8", "threads": 2}},
]
# 135M is the demo checkpoint: its search also offers what the demo does (recipes/demo.yaml), q4_1, which keeps
# its perplexity there (+0.7%) where q4_K_M does not (+6.3%), so the machine chooses among the demo's types.
DEMO_TYPES = [{"name": "llama-q4_1", "optimize": {"method": "gguf", "type": "q4_1"},
               "engine": {"backend": "llama_cpp", "runtime": "library", "threads": 2}}]


# ---------------------------------------------------------------- the checkpoint, shard by shard

def tensor_shapes(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a Llama/Qwen2 checkpoint, in the order the published ones store them."""
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or h // heads
    bias = config["model_type"] == "qwen2"  # Qwen2 has q/k/v biases (no attention_bias field)
    out = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (heads * d, h)),
                (p + "self_attn.k_proj.weight", (kv * d, h)), (p + "self_attn.v_proj.weight", (kv * d, h))]
        if bias:
            out += [(p + "self_attn.q_proj.bias", (heads * d,)), (p + "self_attn.k_proj.bias", (kv * d,)),
                    (p + "self_attn.v_proj.bias", (kv * d,))]
        out += [(p + "self_attn.o_proj.weight", (h, heads * d)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                (p + "mlp.down_proj.weight", (h, inter))]
    out.append(("model.norm.weight", (h,)))
    if not config["tie_word_embeddings"]:
        out.append(("lm_head.weight", (vocab, h)))
    return out


def shard_plan(shapes: list[tuple[str, tuple[int, ...]]], limit: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Tensors grouped into shards of at most `limit` bf16 bytes (a larger tensor gets its own)."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        nbytes = 2 * math.prod(shape)
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def build_checkpoint(config: dict[str, Any], tokenizer_dir: Path, out: Path) -> dict[str, Any]:
    """Random bf16 weights (normal, sd = initializer_range; norms 1), one shard in memory at a time."""
    import torch
    from safetensors.torch import save_file

    if (out / "model.safetensors.index.json").is_file():
        index = json.loads((out / "model.safetensors.index.json").read_text())
        return {"path": str(out), "weight_bytes": index["metadata"]["total_size"], "built_s": None,
                "shards": len(set(index["weight_map"].values()))}
    start = time.perf_counter()
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    shards = shard_plan(tensor_shapes(config), SHARD_BYTES)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape in shard:
            t = torch.empty(shape, dtype=torch.bfloat16)
            if name.endswith("norm.weight"):
                t.fill_(1.0)
            else:
                t.normal_(0.0, config["initializer_range"], generator=gen)
            tensors[name] = t
            weight_map[name] = fname
            total += t.numel() * 2
        save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
        del tensors
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    _tokenizer_and_config(config, tokenizer_dir, tmp)
    tmp.rename(out)
    return {"path": str(out), "weight_bytes": total, "built_s": round(time.perf_counter() - start, 1),
            "shards": len(shards)}


def config_only(config: dict[str, Any], tokenizer_dir: Path, out: Path) -> dict[str, Any]:
    """The published config and the tokenizer without the weights (a one-element placeholder file):
    all `kiln plan-memory` reads. `weight_bytes` is what the bf16 weights would take."""
    from safetensors.torch import save_file
    import torch

    out.mkdir(parents=True, exist_ok=True)
    _tokenizer_and_config(config, tokenizer_dir, out)
    save_file({"placeholder": torch.zeros(1)}, str(out / "model.safetensors"))
    return {"path": str(out), "weights_built": False, "built_s": None, "shards": 0,
            "weight_bytes": 2 * sum(math.prod(shape) for _, shape in tensor_shapes(config))}


def _tokenizer_and_config(config: dict[str, Any], tokenizer_dir: Path, out: Path) -> None:
    """The demo tokenizer's files, and the published config with the demo tokenizer's special ids."""
    demo = json.loads((tokenizer_dir / "config.json").read_text())
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, out / name)
    ids = {k: demo[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if demo.get(k) is not None}
    (out / "config.json").write_text(json.dumps({**config, **ids}, indent=2))


# ---------------------------------------------------------------- the recipe and the memory plan

def recipe(size: str, checkpoint: Path, dtype: str, skip: list[str]) -> dict[str, Any]:
    from kiln.core.gate.quality import min_perplexity_documents
    from kiln.pipeline.stages.phases import family_confidence

    candidates = [c for c in CANDIDATES + (DEMO_TYPES if size == "135m" else []) if c["name"] not in skip]
    # 24 documents decide the perplexity check up to three candidates; the family's confidence needs more beyond
    documents = max(24, min_perplexity_documents(family_confidence(0.95, len(candidates))))
    return {
        "name": f"scale-{size}",
        "description": f"bench/scale.py: {SIZES[size][0]}-shaped checkpoint (random weights) against itself "
                       f"on torch {dtype}; GGUF q8_0/q4_K_M on llama.cpp, OpenVINO int8",
        "model": {"path": str(checkpoint)},
        "baseline": {"engine": {"backend": "torch", "dtype": dtype, "threads": 2}},
        "candidates": candidates,
        "search": {"objective": "decode_tok_s"},
        "evaluate": {"quality": {"perplexity": {"text": "demo", "max_documents": documents, "seq_len": 64},
                                 "agreement": False},
                     "benchmark": {"prompts": "demo", "num_prompts": 4, "max_new_tokens": 16, "repeats": 2}},
        "gate": {"confidence": 0.95, "on_inconclusive": "fail", "checks": [
            {"kind": "quality", "metric": "perplexity", "margin": 0.05, "relative": True},
            {"kind": "performance", "metric": "decode_tok_s", "min_ratio": 1.0}]},
        "tracking": {"experiment": "kiln-scale"},
    }


def plan(recipe_path: Path, available: int, workdir: Path, sets: tuple[str, ...] = ()) -> dict[str, Any]:
    """`kiln plan-memory` as a user runs it (its text and exit code), and the same plans' numbers.
    `sets`: recipe changes (`--set` of both), e.g. another model.path."""
    from kiln.pipeline.stages.memory_plan import arm_plans, run_context
    from kiln.core.home import kiln_cache
    from kiln.pipeline.recipe.model_source import resolve_model
    from kiln.pipeline.recipe.schema import load_recipe

    r = load_recipe(recipe_path, list(sets))
    model = resolve_model(r.model.path, kiln_cache())
    context, batch = run_context(r)  # as `kiln run` plans
    kiln = str(Path(sys.executable).with_name("kiln"))
    cli = subprocess.run([kiln, "plan-memory", str(recipe_path), "--available", str(available), "--context",
                          str(context), "--batch", str(batch), *(a for x in sets for a in ("--set", x))],
                         capture_output=True, text=True, cwd=workdir, env={**os.environ, "COLUMNS": "200"})
    plans = {name: p for name, (_, p) in arm_plans(r, model.config, context=context, batch=batch,
                                                   available=available)[0].items()}
    plans = {name: p.to_dict() for name, p in plans.items()}
    return {"cli_exit_code": cli.returncode, "cli_output": cli.stdout + cli.stderr, "context": context,
            "available_bytes": available, "arms": plans}


# ---------------------------------------------------------------- the run and what its stages recorded

def run_kiln(recipe_path: Path, workdir: Path, timeout_s: int, floor: int, fresh: list[str]) -> dict[str, Any]:
    """`kiln run` from `workdir`, stopped (its whole process group) if it runs past `timeout_s` or the
    machine's available memory falls under `floor` bytes: the machine is shared, and a stage that
    outgrows it must not make the kernel's OOM killer pick someone else's process."""
    import psutil

    kiln = str(Path(sys.executable).with_name("kiln"))
    start = time.perf_counter()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
    stopped, lowest = None, psutil.virtual_memory().available
    with open(workdir / "kiln-run.log", "w") as log:
        fresh = [a for stage in fresh for a in ("--fresh", stage)]
        proc = subprocess.Popen([kiln, "run", str(recipe_path), "--runs", str(workdir / "runs"), *fresh], cwd=workdir,
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        while proc.poll() is None:
            time.sleep(0.25)
            lowest = min(lowest, psutil.virtual_memory().available)
            over = time.perf_counter() - start > timeout_s
            if over or lowest < floor:
                stopped = "timeout" if over else f"available memory fell to {lowest / GIB:.2f} GiB"
                os.killpg(proc.pid, 9)
                proc.wait()
    runs = sorted((workdir / "runs").glob(f"{recipe_path.stem}*"), key=lambda p: p.stat().st_mtime)
    state = json.loads((runs[-1] / "state.json").read_text()) if runs else {}
    return {"exit_code": proc.returncode, "wall_s": round(time.perf_counter() - start, 1), "stopped": stopped,
            "lowest_available_bytes": lowest, "run_dir": str(runs[-1]) if runs else None,
            "verdict": state.get("verdict"), "log_tail": (workdir / "kiln-run.log").read_text().splitlines()[-15:]}


def finished(run_dir: Path) -> dict[str, Any]:
    """A run this script started earlier (its state.json), read instead of run again."""
    state = json.loads((run_dir / "state.json").read_text())
    return {"exit_code": state.get("exit_code"), "wall_s": round(state["finished_at"] - state["started_at"], 1),
            "run_dir": str(run_dir), "verdict": state.get("verdict"), "log_tail": []}


def stage_records(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Every stage any arm ran (keyed `<candidate>/<stage>-<role>`), from its cache manifest."""
    out = {}
    for record in sorted(run_dir.glob("candidates/*/stages/*.json")):
        r = json.loads(record.read_text())
        manifest = json.loads((Path(r["path"]) / "manifest.json").read_text())
        own, kids = manifest.get("peak_rss_bytes", 0), manifest.get("children_peak_pss_bytes", 0)
        out[f"{record.parent.parent.name}/{record.stem}"] = {
            "stage": r["stage"], "role": r["role"], "key": r["key"], "reused": r["reused"], "path": r["path"],
            "wall_s": round(manifest.get("wall_s", 0.0), 1), "peak_rss_bytes": own, "children_peak_pss_bytes": kids,
            "peak_bytes": own + kids, "peak_rss_reset": manifest.get("peak_rss_reset"),
            "start_bytes": manifest.get("start_rss_bytes"),
            "children": [(c["name"], c["peak_rss_bytes"]) for c in manifest.get("children", [])],
            "metrics": {k: v for k, v in r["metrics"].items() if "decode_tok_s" in k or "size_bytes" in k}}
    return out


def bench_gguf(stages: dict[str, dict[str, Any]], runs: int = 3, threads: int = 2, n: int = 64,
               depth: int = 16) -> dict[str, Any]:
    """`llama-bench` tg64 at depth 16 (the positions kiln's decodes cover) of each GGUF the run made."""
    out = {}
    for arm in (c["name"] for c in CANDIDATES + DEMO_TYPES if c["optimize"]["method"] == "gguf"):
        opt = stages.get(f"{arm}/optimize-candidate")
        gguf = next((Path(opt["path"]) / "model").glob("*.gguf"), None) if opt else None
        if gguf is None or runs < 1:
            continue
        done = [llama_cpp_runtimes.cpu_engines.llama_bench(gguf, threads, n, depth, prefill=False) for _ in range(runs)]
        out[arm] = {"gguf": str(gguf), "gguf_bytes": gguf.stat().st_size, "runs": runs,
                    "tg_tok_s": llama_cpp_runtimes._spread([r["bench_tg_tok_s"] for r in done]),
                    "tg_d0_tok_s": llama_cpp_runtimes._spread([r["bench_tg_d0_tok_s"] for r in done])}
    return out


def framed_pick(result: dict[str, Any], rounds: int, threads: int = 2, n: int = 64) -> dict[str, Any] | None:
    """The search's pick, and kiln's q8_0 engine, each against `llama-bench` q8_0 of the same checkpoint
    measured right before and right after it (bench/llama_cpp_runtimes.py's framing): on this shared
    machine the speed of one moment differs from the next by up to 40%, so a ratio of the benchmark
    stage's figure to a `llama-bench` run minutes later says little. Each figure is the engine driven
    directly, as kiln's evaluate stage drives it (a 16-token prompt, then the median of three 64-token
    greedy decodes, first token excluded), over the mean of its two frames (tg64 at depth 16, the same
    positions); the arms alternate order round by round. Median [min, max] of the rounds."""
    from kiln.engine.loader import load_engine

    search = Path(result["run"]["run_dir"]) / "search.json"  # absent when the run stopped before its verdict
    pick = json.loads(search.read_text()).get("winner") if rounds > 0 and search.is_file() else None
    q8 = result.get("llama_bench", {}).get("llama-q8_0")
    if not pick or not q8:
        return None
    arms = [pick] + (["llama-q8_0"] if pick != "llama-q8_0" else [])
    stages = result["stages"]
    engines = {a: load_engine(Path(json.loads((Path(stages[f"{a}/engine-candidate"]["path"]) / "result.json")
                                              .read_text())["engine_dir"])) for a in arms}
    rates: dict[str, list[float]] = {a: [] for a in arms}
    ratios: dict[str, list[float]] = {a: [] for a in arms}
    frames: list[float] = []
    try:
        for e in engines.values():
            llama_cpp_runtimes.direct_rate(e, 8)  # warm-up
        for r in range(rounds):
            for arm in arms if r % 2 == 0 else arms[::-1]:
                before = llama_cpp_runtimes.cpu_engines.llama_bench(Path(q8["gguf"]), threads, n, 16, prefill=False)
                rate = statistics.median(llama_cpp_runtimes.direct_rate(engines[arm], n) for _ in range(3))
                after = llama_cpp_runtimes.cpu_engines.llama_bench(Path(q8["gguf"]), threads, n, 16, prefill=False)
                pair = [before["bench_tg_tok_s"], after["bench_tg_tok_s"]]
                frames += pair
                rates[arm].append(round(rate, 2))
                ratios[arm].append(round(rate / statistics.mean(pair), 3))
    finally:
        for e in engines.values():
            e.close()
    spread = llama_cpp_runtimes._spread
    return {"pick": pick, "rounds": rounds, "llama_bench_q8_0_tok_s": spread(frames),
            "arms": {a: {"tok_s": spread(rates[a]), "over_llama_bench_q8_0": spread(ratios[a]),
                         "over_llama_bench_q8_0_rounds": ratios[a]} for a in arms}}


def _checkpoint(size: str, config: dict[str, Any] | None, demo: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The size's checkpoint: the demo's own at 135M, else built (or found) from the published config."""
    if config is None:
        return {"path": str(demo), "weight_bytes": (demo / "model.safetensors").stat().st_size,
                "built_s": None, "shards": 1}
    if args.plan_only and args.config_only:
        return config_only(config, demo, args.workdir / "models" / f"{size}-config")
    return build_checkpoint(config, demo, args.workdir / "models" / size)


def _run_and_measure(result: dict[str, Any], recipe_path: Path, work: Path, args: argparse.Namespace) -> None:
    """`kiln run` (or a finished run), then llama-bench beside it: into `result`, and its raw JSON written."""
    from kiln.core.files import atomic_write_json
    from kiln.evaluate.roofline import measure_bandwidth
    from kiln.optimize.memory import parse_bytes

    load0, busy0 = os.getloadavg(), contention.read()
    timeout_s = args.timeout_s or TIMEOUT_S[result["size"]]
    result["run"] = (finished(args.from_run) if args.from_run
                     else run_kiln(recipe_path, work, timeout_s, parse_bytes(args.floor), args.fresh))
    if result["run"]["run_dir"]:
        result["stages"] = stage_records(Path(result["run"]["run_dir"]))
        result["llama_bench"] = bench_gguf(result["stages"], args.bench_runs)
        result["framed"] = framed_pick(result, args.framed_rounds)
    result["bandwidth_gb_s"] = round(measure_bandwidth(), 1)
    result["load_average_start"], result["load_average_end"] = load0, os.getloadavg()
    result["contention"] = contention.between(busy0, contention.read())
    atomic_write_json(RESULTS / f"scale-{result['size']}.json", result)  # the raw figures, whatever analyse does
    result["analysis"] = analyse(result)


def measure_size(size: str, args: argparse.Namespace) -> None:
    """Build (or find) the checkpoint, plan it, run it, and write bench/results/scale-<size>.json."""
    import yaml
    from kiln.core.files import atomic_write_json, atomic_write_text
    from kiln.optimize.architecture import DecoderShapes
    from kiln.optimize.memory import available_memory, parse_bytes, source_dtype
    from kiln.pipeline.demo.prepare import demo_model_dir
    from kiln.pipeline.recipe.schema import apply_overrides

    name, config = SIZES[size]
    work = args.workdir / size
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = _checkpoint(size, config, demo_model_dir(), args)
    ckpt = Path(checkpoint["path"])
    dtype = source_dtype(json.loads((ckpt / "config.json").read_text()))
    recipe_path = work / f"scale-{size}.yaml"
    # the recipe change a refusal named, as `kiln run --set` applies it (gate.checks.0.margin=0.15)
    written = apply_overrides(recipe(size, ckpt, dtype, args.skip), args.set)
    atomic_write_text(recipe_path, yaml.safe_dump(written, sort_keys=False))
    available = parse_bytes(args.available) if args.available else available_memory()
    params = DecoderShapes.from_config(json.loads((ckpt / "config.json").read_text())).param_count
    result: dict[str, Any] = {"size": size, "shape_of": name, "checkpoint": checkpoint, "params": params,
                              "stored_dtype": dtype, "baseline_dtype": dtype, "left_out": args.skip,
                              "recipe_changes": args.set,
                              "recipe": str(recipe_path), "plan": plan(recipe_path, available, work),
                              **machine()}
    print(result["plan"]["cli_output"])
    if not args.plan_only and result["plan"]["cli_exit_code"] == 0:
        _run_and_measure(result, recipe_path, work, args)
    atomic_write_json(RESULTS / f"scale-{size}{'-plan' if 'run' not in result else ''}.json", result)
    if args.delete_checkpoint and config is not None:
        shutil.rmtree(ckpt)


def machine() -> dict[str, Any]:
    import psutil

    return {"machine": platform.platform(), "cpu": llama_cpp_runtimes.cpu_engines.cpu_identity(),
            "cpus": os.cpu_count(), "memory_total_bytes": psutil.virtual_memory().total,
            "memory_available_bytes_start": psutil.virtual_memory().available,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def held_bytes(result: dict[str, Any]) -> dict[str, int]:
    """The weight bytes each arm's engine must hold, in the dtype it serves them: the checkpoint at the
    baseline's dtype, each GGUF file, the OpenVINO int8 IR's .bin."""
    per_param = {"float32": 4, "bfloat16": 2, "float16": 2}
    stored = per_param[result.get("stored_dtype", result["baseline_dtype"])]
    held = {"baseline": result["checkpoint"]["weight_bytes"] * per_param[result["baseline_dtype"]] // stored}
    for key, st in result.get("stages", {}).items():
        arm, stage = key.split("/")
        if stage == "engine-candidate":
            done = Path(st["path"]) / "result.json"
            engine = Path(json.loads(done.read_text())["engine_dir"]) if done.is_file() else None
            files = [f for f in engine.rglob("*") if f.suffix in (".gguf", ".bin") and f.is_file()] if engine else []
            # pruned from the cache since: as recorded when it was measured
            held[arm] = sum(f.stat().st_size for f in files) or result.get("analysis", {}).get("held_bytes", {}).get(arm, 0)
    return held


def planned(result: dict[str, Any], arm: str, stage: str) -> float | None:
    """What `kiln plan-memory` predicts for a stage: optimize = the arm's quantize step, engine = the
    larger of its reference step (the parity check's torch reference) and its engine step (the build), quality = its
    quality step (its engine alone, and its torch scoring logits), benchmark = the arm's benchmark step (both arms'
    engines in one process). None for a step it does not plan."""
    arms = result["plan"]["arms"]

    def step(a: str, name: str) -> float | None:
        s = arms.get(a, {}).get("steps", {}).get(name)
        return s["total_bytes"] if s else None
    who = "baseline" if stage.endswith("-baseline") else arm
    if stage == "optimize-candidate":
        return step(arm, "quantize")
    if stage.startswith("engine-"):  # the parity reference, freed before the engine loads: the larger of the two
        held = [b for b in (step(who, "reference"), step(who, "engine")) if b is not None]
        return max(held) if held else None
    if stage.startswith("quality-"):
        return step(who, "quality")
    if stage.startswith("benchmark-"):
        return step(arm, "benchmark")
    return None


def analyse(result: dict[str, Any]) -> dict[str, Any]:
    """Per stage: wall, peak, the bound 1.3 x held weights + 1 GiB, the plan and measured/plan."""
    held = held_bytes(result)
    rows = {}
    for key, st in sorted(result.get("stages", {}).items(), key=lambda kv: kv[1]["reused"]):
        arm, stage = key.split("/")
        if any(r["key"] == st["key"] for r in rows.values()):
            continue  # the same stage (the baseline's, shared by every arm) counted once
        if stage in ("quality-baseline", "engine-baseline", "optimize-baseline"):
            holds = held["baseline"] if stage != "optimize-baseline" else 0
        elif stage == "benchmark-pair":
            holds = held["baseline"] + held.get(arm, 0)
        elif stage == "optimize-candidate":
            holds = result["checkpoint"]["weight_bytes"] if CANDIDATE_METHOD[arm] != "none" else 0
        elif stage == "engine-candidate":  # the parity reference holds the checkpoint as stored, alone, first
            holds = max(result["checkpoint"]["weight_bytes"], held.get(arm, 0))
        else:
            holds = held.get(arm, 0)
        bound = 1.3 * holds + GIB
        plan_b = planned(result, arm, stage)
        rows[key] = {"key": st["key"], "wall_s": st["wall_s"], "peak_bytes": st["peak_bytes"], "holds_bytes": holds,
                     "bound_bytes": bound, "over_bound": st["peak_bytes"] > bound, "plan_bytes": plan_b,
                     "measured_over_plan": round(st["peak_bytes"] / plan_b, 3) if plan_b else None,
                     "reused": st["reused"], "start_bytes": st.get("start_bytes")}
    return {"held_bytes": held, "stages": dict(sorted(rows.items())), "decode": decode(result)}


def decode(result: dict[str, Any]) -> dict[str, Any]:
    """Batch-1 decode tok/s per arm (the benchmark stage's, each pair's median), beside llama-bench of
    the same GGUF and the arm's MBU (weight bytes read per token x tok/s / copy bandwidth)."""
    bw, held = result.get("bandwidth_gb_s"), held_bytes(result)
    out: dict[str, Any] = {}
    for key, st in result.get("stages", {}).items():
        arm, stage = key.split("/")
        if stage != "benchmark-pair":
            continue
        m = st["metrics"]
        out.setdefault("baseline", []).append(m.get("baseline.decode_tok_s"))
        out[arm] = {"tok_s": m.get("candidate.decode_tok_s"), "weight_bytes": held.get(arm)}
    base = [x for x in out.pop("baseline", []) if x]
    if base:
        out["baseline"] = {"tok_s": statistics.median(base), "tok_s_each_pair": base, "weight_bytes": held["baseline"]}
    for arm, d in out.items():
        if bw and d.get("tok_s") and d.get("weight_bytes"):
            d["mbu"] = round(d["weight_bytes"] / 1e9 * d["tok_s"] / bw, 3)
        lb = result.get("llama_bench", {}).get(arm)
        if lb and d.get("tok_s"):
            d["over_llama_bench_same_file"] = round(d["tok_s"] / lb["tg_tok_s"][0], 3)
        q8 = result.get("llama_bench", {}).get("llama-q8_0")
        if q8 and d.get("tok_s"):
            d["over_llama_bench_q8_0"] = round(d["tok_s"] / q8["tg_tok_s"][0], 3)
    return out


def _gb(n: float | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def print_table(paths: list[Path]) -> None:
    """Per size: the run, each stage's wall and peak beside its bound and plan; decode per arm."""
    for path in paths:
        r = json.loads(path.read_text())
        run = r.get("run")
        head = (f"\n{r['size']} ({r['shape_of']}, {r['checkpoint']['weight_bytes'] / 1e9:.2f} GB, "
                f"{r['checkpoint']['shards']} shard(s), baseline torch {r['baseline_dtype']}) on {r['cpu'].get('name')}")
        print(head)
        if not run:
            print(f"  not run: plan-memory exit {r['plan']['cli_exit_code']} at {_gb(r['plan']['available_bytes'])} GiB")
            continue
        r["analysis"] = analyse(r)
        print(f"  kiln run: exit {run['exit_code']} in {run['wall_s']:.0f} s; load average "
              f"{r['load_average_start'][0]:.2f} -> {r['load_average_end'][0]:.2f}; copy bandwidth {r['bandwidth_gb_s']} GB/s")
        print(f"  {'arm/stage':<36}{'wall s':>8}{'start GiB':>10}{'peak GiB':>10}{'bound':>8}{'plan':>8}{'meas/plan':>10}")
        for key, st in r["analysis"]["stages"].items():
            flag = " OVER" if st["over_bound"] else ""
            ratio = "-" if st["measured_over_plan"] is None else f"{st['measured_over_plan']:.2f}"
            print(f"  {key:<36}{st['wall_s']:>8.1f}{_gb(st.get('start_bytes')):>10}{_gb(st['peak_bytes']):>10}{_gb(st['bound_bytes']):>8}"
                  f"{_gb(st['plan_bytes']):>8}{ratio:>10}{flag}")
        print(f"  {'arm':<16}{'tok/s b1':>10}{'MBU':>7}{'/llama-bench same':>19}{'/llama-bench q8_0':>19}")
        for arm, d in r["analysis"]["decode"].items():
            cells = [f"{d[k]:.3f}" if d.get(k) is not None else "-" for k in
                     ("mbu", "over_llama_bench_same_file", "over_llama_bench_q8_0")]
            print(f"  {arm:<16}{d.get('tok_s') or 0:>10.2f}{cells[0]:>7}{cells[1]:>19}{cells[2]:>19}")
        for arm, lb in r.get("llama_bench", {}).items():
            print(f"  llama-bench {arm}: tg64 @16 {lb['tg_tok_s'][0]:.2f} tok/s [{lb['tg_tok_s'][1]}, {lb['tg_tok_s'][2]}]")
        if framed := r.get("framed"):
            print(f"  framed by llama-bench q8_0 ({framed['rounds']} rounds, its frames "
                  f"{framed['llama_bench_q8_0_tok_s'][0]:.1f} tok/s [{framed['llama_bench_q8_0_tok_s'][1]}, "
                  f"{framed['llama_bench_q8_0_tok_s'][2]}]); the pick is {framed['pick']}:")
            for arm, d in framed["arms"].items():
                v = d["over_llama_bench_q8_0"]
                print(f"    {arm:<16}{d['tok_s'][0]:>8.2f} tok/s, {v[0]:.3f}x [{v[1]:.3f}, {v[2]:.3f}] llama-bench q8_0")


CANDIDATE_METHOD = {c["name"]: c["optimize"]["method"] for c in CANDIDATES + DEMO_TYPES}


def growth(paths: list[Path]) -> dict[str, Any]:
    """How each stage's wall time grows with the parameter count: t = a x params^b fitted (least squares
    in log-log) over the sizes that ran it, with each size's measured/fitted ratio; and the check that
    means something: the same fit over every size but the largest, and its prediction for the largest
    (`holdout`: measured / predicted). A reused stage counts with the wall time it took when computed
    (its manifest's). Needs two sizes to fit, three for the held-out check."""
    from kiln.optimize.architecture import DecoderShapes

    points: dict[str, dict[float, float]] = {}
    for path in paths:
        r = json.loads(path.read_text())
        if "stages" not in r or str(r["run"]["exit_code"]) not in ("0", "1", "3"):  # a verdict, not an error
            continue
        params = r.get("params") or DecoderShapes.from_config(
            json.loads((Path(r["checkpoint"]["path"]) / "config.json").read_text())).param_count
        for key, st in r["stages"].items():
            if st["wall_s"] > 0:
                points.setdefault(key, {})[params] = st["wall_s"] * FIT_DOCUMENTS / scored_documents(st, FIT_DOCUMENTS)
    fits = {}
    for key, by_size in sorted(points.items()):
        pts = sorted(by_size.items())
        if len(pts) < 2:
            continue
        a, b = _fit(pts)
        fits[key] = {"exponent": round(b, 3), "a": a, "points": pts,
                     "measured_over_fit": [round(t / (a * p ** b), 3) for p, t in pts]}
        if len(pts) >= 3:
            ha, hb = _fit(pts[:-1])
            (p, t) = pts[-1]
            fits[key]["holdout"] = {"params": p, "measured_s": t, "predicted_s": round(ha * p ** hb, 1),
                                    "exponent": round(hb, 3), "measured_over_predicted": round(t / (ha * p ** hb), 3)}
    return fits


# A quality stage's time is proportional to the documents it scores, which a run may raise (3B: 100, so that
# the perplexity check has the power to decide on random weights): the fit takes its time per this many.
FIT_DOCUMENTS = 24


def scored_documents(stage: dict[str, Any], default: int) -> int:
    """The documents a quality stage scored (its result.json in the stage cache), else `default`."""
    path = Path(stage.get("path", "")) / "result.json"
    if stage.get("stage") != "quality" or not path.is_file():
        return default
    return json.loads(path.read_text()).get("metrics", {}).get("documents") or default


def _fit(pts: list[tuple[float, float]]) -> tuple[float, float]:
    """(a, b) of t = a x params^b, least squares in log-log."""
    xs, ys = [math.log(p) for p, _ in pts], [math.log(t) for _, t in pts]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return math.exp(my - b * mx), b


def markdown(paths: list[Path]) -> None:
    """The memory table docs/engines.md shows: per stage, each size's peak (GiB) / plan, and the bound."""
    runs = [json.loads(p.read_text()) for p in paths]
    runs = [{**r, "analysis": analyse(r)} for r in runs if r.get("stages") and str(r["run"]["exit_code"]) in ("0", "1", "3")]
    keys = sorted({k for r in runs for k in r["analysis"]["stages"]})
    print("| stage | " + " | ".join(f"{r['size']}: peak / plan (bound)" for r in runs) + " |")
    print("| --- |" + " --- |" * len(runs))
    for key in keys:
        cells = []
        for r in runs:
            st = r["analysis"]["stages"].get(key)
            if st is None:
                cells.append("—")
                continue
            plan_ = "—" if st["plan_bytes"] is None else f"{st['plan_bytes'] / GIB:.2f}"
            over = "**" if st["over_bound"] else ""
            cells.append(f"{over}{st['peak_bytes'] / GIB:.2f}{over} / {plan_} ({st['bound_bytes'] / GIB:.2f})")
        print(f"| {key} | " + " | ".join(cells) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=list(SIZES), action="append", default=[])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/kiln-scale"), help="checkpoints, recipes, kiln's runs")
    p.add_argument("--available", default=None, help="memory to plan against (24G); default: free now")
    p.add_argument("--plan-only", action="store_true", help="build the checkpoint and plan it; run nothing")
    p.add_argument("--config-only", action="store_true", help="with --plan-only: plan from config.json alone, "
                   "building no weights")
    p.add_argument("--timeout-s", type=int, default=None,
                   help="stop kiln run after this long (default by size: "
                   + ", ".join(f"{k} {v} s" for k, v in TIMEOUT_S.items()) + ")")
    p.add_argument("--delete-checkpoint", action="store_true", help="remove the built checkpoint afterwards")
    p.add_argument("--floor", default="1.5G", help="stop kiln run if the machine's available memory falls under this")
    p.add_argument("--skip", action="append", default=[], choices=[c["name"] for c in CANDIDATES + DEMO_TYPES],
                   help="leave this candidate out of the recipe (repeatable); the JSON says so")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="change the written recipe (a dotted key, a YAML value), as a refusal's fix says")
    p.add_argument("--bench-runs", type=int, default=3, help="llama-bench runs per GGUF (each -r 2, two depths)")
    p.add_argument("--framed-rounds", type=int, default=5, help="rounds of the pick (and kiln's q8_0) driven "
                   "directly between two llama-bench q8_0 runs (0: none)")
    p.add_argument("--fresh", action="append", default=[], help="kiln run --fresh STAGE: measure it again "
                   "(benchmark: decode beside this run's llama-bench)")
    p.add_argument("--from-run", type=Path, default=None, help="read this finished run folder instead of running")
    p.add_argument("--replan", action="store_true", help="plan every recorded size again with the planner as it is now")
    p.add_argument("--markdown", action="store_true", help="print the memory table as markdown (docs/engines.md)")
    p.add_argument("--table", action="store_true", help="only print the table of every scale-*.json")
    args = p.parse_args()
    for size in args.size if not args.table else []:
        measure_size(size, args)
    if args.replan:
        for path in RESULTS.glob("scale-*.json"):
            replan(path)
    paths = sorted(RESULTS.glob("scale-*.json"))
    if args.markdown:
        markdown(paths)
        return
    print_table(paths)
    fits = growth(paths)
    if fits:
        print("\nwall time ~ params^b per stage (log-log least squares over the sizes that ran it; a quality stage's"
              f" time per {FIT_DOCUMENTS} documents scored):")
        for key, f in fits.items():
            held = f.get("holdout")
            check = (f"; fitted without the largest: predicts {held['predicted_s']:.0f} s at "
                     f"{held['params'] / 1e9:.2f}B, measured {held['measured_s']:.0f} s "
                     f"({held['measured_over_predicted']:.2f}x)") if held else ""
            print(f"  {key:<36} b = {f['exponent']:.2f}  measured/fit {f['measured_over_fit']}{check}")


def replan(path: Path) -> None:
    """The plan of a recorded size made again with the planner as it is now (the one the run saw is
    kept as `plan_at_run`), so a fix to the planner is checked against the peaks already measured."""
    from kiln.core.files import atomic_write_json

    from kiln.pipeline.demo.prepare import demo_model_dir

    r = json.loads(path.read_text())
    sets: tuple[str, ...] = ()
    if not (Path(r["checkpoint"]["path"]) / "config.json").is_file():  # deleted since: plan its config alone
        stand_in = config_only(SIZES[r["size"]][1], demo_model_dir(), Path(r["recipe"]).parent / "config-only")
        sets = (f"model.path={stand_in['path']}",)
    r.setdefault("plan_at_run", r["plan"])
    r["plan"] = plan(Path(r["recipe"]), r["plan_at_run"]["available_bytes"], Path(r["recipe"]).parent, sets)
    if "stages" in r:
        r["analysis"] = analyse(r)
    atomic_write_json(path, r)


if __name__ == "__main__":
    main()
