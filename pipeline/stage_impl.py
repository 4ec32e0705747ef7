"""The concrete stages of `kiln run`, each a call to `run_stage` with its content-addressed inputs."""

from __future__ import annotations

import functools
import json
import statistics
from pathlib import Path
from typing import Any

from kiln.optimize.base import QUANTIZERS, ModelArtifact
from kiln.core.errors import BadInput
from kiln.pipeline.evidence import evidence_from_run
from kiln.core.files import atomic_write_json, dir_size, hash_of, read_json, sha256_file
from kiln.core.gate.base import Evidence, Verdict
from kiln.core.gate.policy import GateOutcome, judge
from kiln.core.metrics import LOAD_PREFIX
from kiln.pipeline.model_source import ResolvedModel
from kiln.pipeline.phases import for_family, phase_of
from kiln.pipeline.stages import RunContext, StageOutcome, peak_rss_bytes, run_stage, run_tags
from kiln.core.versions import library_versions


def optimize_both(ctx: RunContext, model: ResolvedModel) -> dict[str, ModelArtifact]:
    baseline_cfg = QUANTIZERS.config("none")()
    return {role: quantize(ctx, role, cfg, model)
            for role, cfg in (("baseline", baseline_cfg), ("candidate", ctx.recipe.optimize))}


def quantize(ctx: RunContext, role: str, cfg: Any, model: ResolvedModel) -> ModelArtifact:
    """One optimize stage: check before any work, calibrate if needed, quantize, write the manifest."""
    quantizer = QUANTIZERS.create(cfg)
    quantizer.check(model.config)
    _plan_memory(ctx, cfg, model).check()  # refuse with the numbers before loading anything
    calibration = _calibration(ctx, cfg, model) if quantizer.needs_calibration else None
    inputs = {"method": cfg.model_dump(mode="json"), "source": model.sha256,
              "calibration": calibration.sha256 if calibration else None}

    def compute(out: Path) -> dict[str, Any]:
        import time as _t

        start = _t.perf_counter()
        fields = quantizer.quantize(model.path, out / "model", calibration)
        manifest = {"method": cfg.method, "params": cfg.model_dump(mode="json"), "source": str(model.path),
                    "source_sha256": model.sha256, "calibration_sha256": inputs["calibration"],
                    "libraries": library_versions(), "wall_s": _t.perf_counter() - start,
                    "peak_rss_bytes": peak_rss_bytes(), "size_bytes": dir_size(out / "model"), **fields}
        from kiln.optimize.checkpoint import canonicalize_safetensors
        from kiln.core.files import sha256_tree

        if quantizer.artifact_format == "safetensors":  # a GGUF file is written by llama.cpp, byte-stable itself
            canonicalize_safetensors(out / "model")  # same weights, same bytes: the hash chain holds
        manifest["sha256"] = sha256_tree(out / "model")
        atomic_write_json(out / "model" / "kiln-artifact.json", manifest)
        metrics = {"quantize_s": manifest["wall_s"], "size_bytes": manifest["size_bytes"],
                   "peak_rss_bytes": manifest["peak_rss_bytes"], "bits_per_weight": manifest.get("bits_per_weight")}
        return {"metrics": metrics, "manifest": manifest}

    o = run_stage(ctx, "optimize", role, inputs, compute, artifacts=("model/kiln-artifact.json",), portable=False)
    return ModelArtifact(path=o.path / "model", manifest=o.result["manifest"])


def _plan_memory(ctx: RunContext, cfg: Any, model: ResolvedModel) -> Any:
    from kiln.optimize.memory import plan_memory

    ev = ctx.recipe.evaluate
    context = max(ev.quality.perplexity.seq_len, 512 + ev.benchmark.max_new_tokens)
    return plan_memory(model.config, cfg, context=context, batch=max(ev.benchmark.batch_sizes))


def _calibration(ctx: RunContext, cfg: Any, model: ResolvedModel):
    """Calibration samples, refused if they overlap the text the candidate is evaluated on."""
    from kiln.optimize.calibration import build_calibration, check_disjoint

    text = calibration_text(cfg.calibration.dataset)
    check_disjoint(text, _text_path(ctx.recipe.evaluate.quality.perplexity.text))
    return build_calibration(cfg.calibration, model.path, text)


def calibration_text(dataset: str) -> Path:
    """The calibration file a recipe names: 'demo' (kiln's Austen calibration text) or a local file."""
    from kiln.optimize.calibration import resolve_dataset

    if dataset == "demo":
        from kiln.pipeline.demo import prepare_demo_data

        return Path(prepare_demo_data().calibration_text)
    return resolve_dataset(dataset)


def engine(ctx: RunContext, role: str, art: ModelArtifact) -> Path:
    """The role's engine, built once per config and artifact: `engine`, or for the baseline
    `baseline.engine` when the recipe sets one (then the two arms may run on different backends).

    With `tune` set, both roles on that engine get the knobs tuned on the candidate (`tune_engine`): the
    gate then compares the two models served the same way, so what it sees comes from the
    optimization, not from knobs that happen to suit one arm. Tuning the baseline separately
    would confound the two."""
    from kiln.engine.base import BACKENDS
    from kiln.engine.cache import build_engine
    from kiln.evaluate import parity
    from kiln.evaluate.tune import with_knobs

    cfg = ctx.recipe.engine_for(role)
    if ctx.recipe.tune and cfg is ctx.recipe.engine:  # a baseline on its own engine is served untuned
        candidate = art if role == "candidate" else ModelArtifact(
            path=ctx.outcomes["optimize:candidate"].path / "model",
            manifest=ctx.outcomes["optimize:candidate"].result["manifest"])
        cfg = with_knobs(cfg, tune_engine(ctx, candidate).result["winner"])

    def compute(out: Path) -> dict[str, Any]:
        engine_dir = build_engine(cfg, art.path, art.manifest["sha256"], ctx.cache)
        figures = _parity_smoke(ctx, engine_dir, art)
        if figures is None:
            return {"engine_dir": str(engine_dir), "metrics": {}}
        atomic_write_json(out / "parity.json", figures)
        summary = {k: v for k, v in figures.items() if k != "per_prompt"}
        return {"engine_dir": str(engine_dir), "parity": summary, "metrics": {
            f"parity_{k}": summary[k] for k in ("identical", "max_abs_logprob", "mean_abs_logprob")
            if summary[k] is not None}}

    # "parity" keys the stage, so an engine built before the smoke check existed is checked once; the
    # backend's revision (engine/cache.py's key holds it too) so a changed adapter is built and measured again.
    revision = BACKENDS.get(cfg.backend).revision
    outcome = run_stage(ctx, "engine", role, {"backend": cfg.model_dump(mode="json"), "artifact": art.manifest["sha256"],
                                              "parity": {"prompts": parity.PROMPTS, "tokens": parity.NEW_TOKENS,
                                                         "shortest": parity.SHORTEST_TEXTS},
                                              **({"revision": revision} if revision else {})},
                        compute, artifacts=("parity.json",), portable=False)
    return Path(outcome.result["engine_dir"])


def _parity_smoke(ctx: RunContext, engine_dir: Path, art: ModelArtifact) -> dict[str, Any] | None:
    """A few greedy prompts through the built engine and the float32 torch reference on the same
    checkpoint (kiln.evaluate.parity); an unquantized build that is not exact is refused here.
    None for a remote endpoint: nothing was built, and what it serves is not this checkpoint's to check."""
    from kiln.engine.loader import load_engine, read_manifest
    from kiln.evaluate import parity

    manifest = read_manifest(engine_dir)
    if manifest["backend"] == "remote":
        return None
    b = ctx.recipe.evaluate.benchmark
    prompts = _prompts(b.prompts, min(parity.PROMPTS, b.num_prompts), _tokenizer(engine_dir))
    quantized = art.manifest.get("method", "none") != "none"
    engine = load_engine(engine_dir)
    # A float32 torch engine is the reference backend itself: it is checked against itself one
    # request at a time (its batching), without loading the checkpoint a second time.
    itself = manifest["backend"] == "torch" and manifest["config"].get("dtype") == "float32"
    checkpoint = parity.reference_checkpoint(art.path, *_unquantized_sources(ctx, art))
    reference = engine if itself else parity.reference_engine(checkpoint, getattr(ctx.recipe.engine, "threads", None))
    try:
        label = f"the {manifest['backend']} engine {engine_dir.name} ({_precision(manifest)})"
        figures = parity.check_build(engine, reference, prompts, parity.unquantized(manifest, quantized), label)
    finally:
        engine.close()
        if not itself:
            reference.close()
    figures["reference"] = "this engine, one request at a time" if itself else "torch float32, one request at a time"
    if not itself and checkpoint != art.path:
        figures["reference"] += f", on the source checkpoint {checkpoint}"
    ctx.console.print(f"  parity vs {figures['reference']}: {figures['identical']:.0%} of {figures['prompts']} greedy prompts "
                      f"identical, max |delta log-prob| {figures['max_abs_logprob']}", markup=False)
    return figures


def _unquantized_sources(ctx: RunContext, art: ModelArtifact) -> list[Path | str | None]:
    """Where the unquantized weights `art` was made from are, best first: this run's baseline
    artifact (a `none` pass-through in the cache) when it was made from the same source, then the
    folder the artifact's manifest recorded, which a reused stage may have outlived."""
    sources: list[Path | str | None] = []
    base = ctx.outcomes.get("optimize:baseline")
    if base is not None and base.result["manifest"].get("source_sha256") == art.manifest.get("source_sha256"):
        sources.append(base.path / "model")
    sources.append(art.manifest.get("source"))
    return sources


def _precision(manifest: dict[str, Any]) -> str:
    c = manifest["config"]
    return str(c.get("dtype") or c.get("quantization") or c.get("weights") or "precision unknown")


def tune_engine(ctx: RunContext, art: ModelArtifact) -> StageOutcome:
    """Search the recipe's `tune` space on `art`, once per run; a cached stage, so re-running does
    not re-tune. Every trial is logged as a child of the stage's MLflow run."""
    from kiln.evaluate.tune import log_trials, tune, tune_inputs

    if "tune:candidate" in ctx.outcomes:
        return ctx.outcomes["tune:candidate"]
    cfg, space, sha = ctx.recipe.engine, ctx.recipe.tune, art.manifest["sha256"]
    outcome = run_stage(ctx, "tune", "candidate", tune_inputs(cfg, space, sha),
                        lambda out: tune(cfg, space, art.path, sha, ctx.cache, out,
                                         log=lambda s: ctx.console.print(s, markup=False)))
    log_trials(ctx.tracker, outcome.mlflow_run, outcome.result, outcome.reused)
    return outcome


def _text_path(spec: str) -> Path:
    if spec == "demo":
        from kiln.pipeline.demo import prepare_demo_data

        return Path(prepare_demo_data().eval_text)
    path = Path(spec).expanduser()
    if not path.is_file():
        raise BadInput(f"evaluate.quality.perplexity.text: {spec} is not a file; give a local .txt file or 'demo'.")
    return path


PHASES = ("quality", "agreement", "speed", "rest")


def evaluate(ctx: RunContext, engines: dict[str, Path], phases: tuple[str, ...] = PHASES,
             loaded: LazyEngines | None = None) -> None:
    """Perplexity of each arm (quality), token agreement between them (agreement), the interleaved
    decode benchmark (speed), then the served text, lm-eval tasks and load over HTTP (rest): the cheap
    checks first, so a search stops a candidate that failed one before its expensive stages."""
    from kiln.engine.loader import load_engine
    from kiln.evaluate.quality.base import documents

    q = ctx.recipe.evaluate.quality
    own = loaded is None
    loaded = LazyEngines(engines, load_engine) if loaded is None else loaded
    if "quality" in phases or ("agreement" in phases and q.agreement):
        text = _text_path(q.perplexity.text).read_text()
        docs = token_ids(ctx, engines["baseline"], {"documents": hash_of(text), "seq_len": q.perplexity.seq_len,
                                                    "max_documents": q.perplexity.max_documents},
                         lambda tok: documents(tok, text, q.perplexity.seq_len, q.perplexity.max_documents))
        text_inputs = {"text": q.perplexity.text, "docs_hash": hash_of(docs)}
        if "quality" in phases:
            for role in engines:
                _perplexity(ctx, role, loaded, engines[role], docs, text_inputs)
        if "agreement" in phases and q.agreement:
            _agreement(ctx, loaded, engines, docs, text_inputs)
    if "speed" in phases:
        benchmark(ctx, loaded, engines)
    if "rest" in phases:
        if q.served:
            _served(ctx, loaded, engines, q.served)
        if q.lmeval:
            for role in engines:
                _lmeval(ctx, role, loaded, engines[role], q.lmeval)
        if ctx.recipe.evaluate.load:
            load_stage(ctx, loaded, engines)
    if own:
        loaded.close()


class LazyEngines(dict):
    """Engines loaded on first use: a fully cached run loads no model at all."""

    def __init__(self, dirs: dict[str, Path], load: Any):
        super().__init__()
        self.dirs, self.load = dirs, load

    def __missing__(self, role: str) -> Any:
        self[role] = self.load(self.dirs[role])
        return self[role]

    def close(self) -> None:
        for engine in self.values():
            engine.close()


def _tokenizer(engine_dir: Path) -> Any:
    from kiln.engine.loader import read_manifest

    return _tokenizer_at(str(read_manifest(engine_dir)["source"]["path"]))


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".onnx", ".xml")


@functools.lru_cache(maxsize=8)
def _tokenizer_files_hash(path: str) -> str:
    """The checkpoint's tokenizer as content: every small file beside the weights (tokenizer.json,
    its config, vocab and merges, the model config), by name and bytes."""
    files = sorted(f for f in Path(path).iterdir()
                   if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and f.stat().st_size < 64 << 20)
    return hash_of({f.name: sha256_file(f) for f in files})


def token_ids(ctx: RunContext, engine_dir: Path, what: dict[str, Any], produce: Any) -> list[list[int]]:
    """`produce(tokenizer)`'s token ids, kept in the cache under the tokenizer's files, the
    transformers version and `what` (the text's hash and how it is cut). A run whose stages are all
    reused then never loads transformers' tokenizer (5-8 s here, mostly imports) just to rebuild
    the stage keys."""
    from importlib.metadata import version

    from kiln.engine.loader import read_manifest

    source = str(read_manifest(engine_dir)["source"]["path"])
    key = hash_of({"tokenizer": _tokenizer_files_hash(source), "transformers": version("transformers"), **what})
    path = ctx.cache / "tokenized" / f"{key}.json"
    if path.exists():
        return read_json(path)
    ids = [list(map(int, seq)) for seq in produce(_tokenizer_at(source))]
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, ids)
    return ids


@functools.lru_cache(maxsize=8)
def _tokenizer_at(path: str) -> Any:
    """One tokenizer per checkpoint and process (~2 s each to load; a search asks for it per stage)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _perplexity(ctx: RunContext, role: str, loaded: LazyEngines, engine_dir: Path, docs, text_inputs) -> None:
    from kiln.evaluate.quality.perplexity import perplexity

    def compute(out: Path) -> dict[str, Any]:
        res = perplexity(loaded[role], docs)
        res.write(out)
        return {"metrics": res.metrics, "samples": {"file": "perplexity.jsonl", "columns": ["nll", "tokens"]}}

    run_stage(ctx, "quality", role, {"engine": engine_dir.name, **text_inputs, "eval": "perplexity"},
              compute)


def _lmeval(ctx: RunContext, role: str, loaded: LazyEngines, engine_dir: Path, cfg: Any) -> None:
    """lm-eval tasks through the engine; keyed by each task's content fingerprint."""
    import tempfile

    from kiln.evaluate.quality.lmeval import evaluate_lmeval, prepare_tasks

    with tempfile.TemporaryDirectory() as tmp:
        fingerprints = prepare_tasks(cfg.tasks, Path(tmp)).fingerprints()

    def compute(out: Path) -> dict[str, Any]:
        results = evaluate_lmeval(loaded[role], cfg, out)
        samples = [{"file": f"{r.name}.jsonl",
                    "columns": sorted({k for rec in r.records for k in rec if k.startswith(f"{r.name}_")})}
                   for r in results]
        return {"metrics": {k: v for r in results for k, v in r.metrics.items()}, "samples": samples}

    run_stage(ctx, "lmeval", role, {"engine": engine_dir.name, "tasks": fingerprints, "limit": cfg.limit},
              compute)


def _agreement(ctx: RunContext, loaded: LazyEngines, engines: dict[str, Path], docs, text_inputs) -> None:
    from kiln.evaluate.quality.agreement import agreement

    def compute(out: Path) -> dict[str, Any]:
        res = agreement(loaded["baseline"], loaded["candidate"], docs)
        res.write(out)
        return {"metrics": res.metrics, "samples": {"file": "agreement.jsonl", "columns": [
            "kl_mean", "kl_p99", "top1_agreement", "greedy_match"]}}

    run_stage(ctx, "agreement", "candidate",
              {"baseline": engines["baseline"].name, "candidate": engines["candidate"].name, **text_inputs},
              compute)


def _served(ctx: RunContext, loaded: LazyEngines, engines: dict[str, Path], cfg: Any) -> None:
    """The candidate's own `kiln serve` (a second copy of its engine, loaded by the server) under
    concurrent mixed-length requests, against the baseline one request at a time."""
    from kiln.engine.loader import load_engine, read_manifest
    from kiln.evaluate.parity import SHORTEST_TEXTS
    from kiln.evaluate.quality.served import served_text

    prompts = _cached_prompts(ctx, engines["baseline"], ctx.recipe.evaluate.benchmark.prompts, cfg.num_prompts,
                              "evaluate.quality.served.num_prompts")

    def compute(out: Path) -> dict[str, Any]:
        res = served_text(loaded["baseline"], lambda: load_engine(engines["candidate"]),
                          read_manifest(engines["candidate"])["source"]["path"], prompts, cfg)
        res.write(out)
        return {"metrics": res.metrics, "samples": {"file": "served.jsonl", "columns": ["served_match", "served_prefix"]}}

    run_stage(ctx, "served", "candidate",
              {"baseline": engines["baseline"].name, "candidate": engines["candidate"].name,
               "config": cfg.model_dump(mode="json"), "prompts": hash_of(prompts), "shortest": SHORTEST_TEXTS},
              compute)


def benchmark(ctx: RunContext, loaded: LazyEngines, engines: dict[str, Path], confirmation: bool = False) -> None:
    """The interleaved decode benchmark. `confirmation`: a second, fresh measurement of a search's
    winner (its own stage key), which then stands as the run's benchmark. It stops after a round
    once a speed check has already Failed (see `futility_policy`): a candidate slower than the
    gate allows stops consuming time."""
    from kiln.engine.cache import hardware_fingerprint
    from kiln.evaluate.decode_bench import interleaved

    b = ctx.recipe.evaluate.benchmark
    # A confirmation is held out: the next num_prompts prompts of the set, which the screening never ran.
    prompts = _cached_prompts(ctx, engines["baseline"], b.prompts, b.num_prompts * (2 if confirmation else 1),
                              CONFIRMATION_PROMPTS if confirmation else "evaluate.benchmark.num_prompts")
    prompts = prompts[-b.num_prompts:]
    futility = futility_policy(ctx, b.repeats) if set(engines) == {"baseline", "candidate"} else None

    def compute(out: Path) -> dict[str, Any]:
        from kiln.evaluate import contention

        watch = contention.Watch()  # how busy the machine is meanwhile
        stopped: dict[str, Any] = {}

        def stop(samples: dict[str, dict[str, list[float]]]) -> bool:
            verdict = judge(futility, Evidence("candidate", metrics=contention.as_metrics(watch.figures()),
                                               repeats=samples["candidate"]),
                            Evidence("baseline", repeats=samples["baseline"]))
            failed = [r for r in verdict.results if r.verdict is Verdict.FAILED]
            if failed:
                rounds = len(samples["candidate"]["decode_tok_s"]) // len(prompts)
                stopped.update(after_round=rounds, of=b.repeats, checks=[f"{r.name}: {r.reason}" for r in failed])
                ctx.console.print(f"  benchmark stopped after round {rounds} of {b.repeats}: "
                                  + "; ".join(stopped["checks"]) + " (already Failed at "
                                  f"{futility.confidence:.2%}, the check's confidence shared by the rounds)",
                                  markup=False)
            return bool(failed)

        with watch:
            per_arm = interleaved({role: loaded[role] for role in engines}, prompts, b.max_new_tokens,
                                  b.batch_sizes, b.repeats, stop=stop if futility else None)
            machine = watch.figures()
        atomic_write_json(out / "repeats.json", per_arm)
        per_role = {role: {"repeats": samples, "metrics": {
            **{k: statistics.median(v) for k, v in samples.items()},
            **contention.as_metrics(machine)}}
            for role, samples in per_arm.items()}
        metrics = {f"{role}.{k}": v for role, part in per_role.items() for k, v in part["metrics"].items()}
        return {"metrics": metrics, "per_role": per_role, "machine": machine, **({"stopped": stopped} if stopped else {})}

    run_stage(ctx, "benchmark", "pair",
              {"engines": {r: p.name for r, p in engines.items()}, "config": b.model_dump(mode="json"),
               "hardware": hardware_fingerprint(), "prompts": hash_of(prompts), "pairing": "per-prompt",
               "records": "contention by signal, steal", "prefill": "uncached", **_confirmation(ctx, confirmation, b.num_prompts),
               **({"stops_when_failed": futility.model_dump(mode="json")} if futility else {})},
              compute)


CONFIRMATION_PROMPTS = ("evaluate.benchmark.num_prompts (a search confirms its winner on the next num_prompts "
                        "prompts, which its screening did not run: the set needs twice num_prompts)")


def _confirmation(ctx: RunContext, confirmation: bool, held_out: int = 0) -> dict[str, Any]:
    """What makes a confirmation's stage key its own: this run (it is measured afresh by every run,
    never reused from a cache or a tracking server) and, for the decode benchmark, its prompts
    (the set's prompts num_prompts to 2 x num_prompts - 1)."""
    if not confirmation:
        return {}
    split = {"prompts_held_out": [held_out, 2 * held_out]} if held_out else {}
    return {"confirmation": {"run": ctx.parent_run, **split}}


def futility_policy(ctx: RunContext, rounds: int) -> Any:
    """The checks the decode benchmark decides, as the benchmark may judge them after each round:
    the policy this run is judged at (a search's family policy), those checks only, each at its
    confidence shared by the rounds (Bonferroni over the looks). A look that finds one Failed stops
    the benchmark: its interval at the stricter look confidence lies wholly past the bound, so the
    final verdict on the same pairs is Failed too, and a candidate that truly meets the bound is
    stopped at most the check's own error rate. Only Failed stops it (a pass is measured in full).
    None: nothing to decide early."""
    policy = ctx.gate or ctx.recipe.gate
    checks = [c for c in policy.checks if phase_of(c) == "speed"]
    if not checks or rounds < 2:
        return None
    return for_family(policy.model_copy(update={"checks": checks}), rounds)


def load_stage(ctx: RunContext, loaded: LazyEngines, engines: dict[str, Path], confirmation: bool = False) -> None:
    """Both arms served over HTTP under the recipe's load shape (see kiln.pipeline.load_stage).
    `confirmation`: a search's winner measured again, fresh (its own stage key), as `benchmark`."""
    from kiln.engine.cache import hardware_fingerprint
    from kiln.pipeline.load_stage import measure

    cfg = ctx.recipe.evaluate.load
    run_stage(ctx, "load", "pair",
              {"engines": {r: p.name for r, p in engines.items()}, "config": cfg.model_dump(mode="json"),
               "hardware": hardware_fingerprint(), **_confirmation(ctx, confirmation)},
              lambda out: measure({role: loaded[role] for role in engines}, engines, cfg, out))


def _prompts(spec: str, n: int, tokenizer: Any, count_field: str = "evaluate.benchmark.num_prompts") -> list[list[int]]:
    return _encode(tokenizer, read_prompts(spec, n, count_field))


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def _cached_prompts(ctx: RunContext, engine_dir: Path, spec: str, n: int,
                    count_field: str = "evaluate.benchmark.num_prompts") -> list[list[int]]:
    texts = read_prompts(spec, n, count_field)
    return token_ids(ctx, engine_dir, {"prompts": hash_of(texts)}, lambda tok: _encode(tok, texts))


def read_prompts(spec: str, n: int, count_field: str = "evaluate.benchmark.num_prompts") -> list[str]:
    """The first `n` prompts of a JSONL file (one object with a 'prompt' string per line), or 'demo'."""
    from kiln.core import yaml_input

    if spec == "demo":
        from kiln.pipeline.demo import prepare_demo_data

        spec = str(prepare_demo_data().prompts)
    path, field = Path(spec), "evaluate.benchmark.prompts"
    if not path.is_file():
        raise BadInput(f"{field}: {path} not found; give a JSONL file with a 'prompt' field or 'demo'.")
    texts = []
    for number, line in enumerate(yaml_input.read_text(path, "prompts file").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise BadInput(f"{field}: {path} line {number} is not JSON; the file is JSONL, one "
                           '{"prompt": "..."} object per line.') from None
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            texts.append(row["prompt"])
        if len(texts) == n:
            return texts
    raise BadInput(f"{field}: {path} has {len(texts)} rows with a 'prompt' string; "
                   f"{count_field} asks for {n}.")


def check_inputs(ctx: RunContext, model: ResolvedModel) -> None:
    """The recipe's input files, and whether its engines can build the checkpoint, checked before
    any stage runs: a bad one is refused in seconds, not after the optimize and engine stages."""
    ev = ctx.recipe.evaluate
    _text_path(ev.quality.perplexity.text)
    read_prompts(ev.benchmark.prompts, ev.benchmark.num_prompts)
    if len(ctx.recipe.candidates or []) > 1 and not (ctx.recipe.search.objective or "").startswith(LOAD_PREFIX):
        read_prompts(ev.benchmark.prompts, 2 * ev.benchmark.num_prompts, CONFIRMATION_PROMPTS)
    if ev.quality.served:
        read_prompts(ev.benchmark.prompts, ev.quality.served.num_prompts, "evaluate.quality.served.num_prompts")
    check_backends(ctx.recipe, model.config)


def check_backends(recipe: Any, config: dict[str, Any]) -> None:
    """Each engine the recipe builds can take the checkpoint whose config.json is `config`
    (EngineBackend.refuses); a refusal names the field and a backend that can."""
    from kiln.engine.base import BACKENDS

    engines = [("", recipe.engine)] if recipe.candidates is None else [
        (f"candidates.{i}.", c.engine) for i, c in enumerate(recipe.candidates) if not c.champion]
    if recipe.baseline.engine is not None:
        engines.append(("baseline.", recipe.baseline.engine))
    for where, engine in engines:
        why = BACKENDS.get(engine.backend).refuses(config)
        if why:
            raise BadInput(f"{where}engine.backend '{engine.backend}' cannot build model.path's checkpoint: {why}. "
                           "Serve it on engine.backend torch, which runs any transformers causal LM.")


def log_evaluation_data(ctx: RunContext) -> None:
    """The texts the verdict was measured on, as the parent run's inputs (MLflow's Dataset column)."""
    ev = ctx.recipe.evaluate
    text = _text_path(ev.quality.perplexity.text)
    ctx.tracker.log_data(ctx.parent_run, "perplexity", text, "text", [t for t in text.read_text().splitlines() if t.strip()])
    if ev.benchmark.prompts == "demo":
        from kiln.pipeline.demo import prepare_demo_data

        prompts = Path(prepare_demo_data().prompts)
    else:
        prompts = Path(ev.benchmark.prompts)
    ctx.tracker.log_data(ctx.parent_run, "benchmark", prompts, "prompt", read_prompts(str(prompts), ev.benchmark.num_prompts))


def gate(ctx: RunContext, policy: Any = None, results: list[Any] | None = None, ending: Any = None,
         subject: str = "the candidate", detail: str = "") -> tuple[GateOutcome, dict[str, Evidence]]:
    """The run's outcome: the recipe's gate (a search passes its family-corrected policy) on the
    run's evidence, or the `results` a search assembled for its subject, ended as `ending` says
    (kiln.pipeline.outcomes, the one table of endings)."""
    from kiln.pipeline.outcomes import Ending, conclude

    evidence = evidence_from_run(ctx.run_dir)
    policy = policy or ctx.recipe.gate
    if results is None:
        results = judge(policy, evidence["candidate"], evidence["baseline"]).results
    outcome = conclude(results, policy.on_inconclusive, ending or Ending.JUDGED, subject, detail)
    run_id = ctx.tracker.start("gate", {"kiln.stage": "gate", "kiln.role": "candidate", **run_tags(ctx),
                                        "kiln.verdict": outcome.verdict.value}, parent=ctx.parent_run)
    atomic_write_json(ctx.run_dir / "verdict.json", outcome.to_dict())
    ctx.tracker.log(run_id, tags={f"kiln.check.{r.name}": r.verdict.value for r in outcome.results},
                    metrics={f"{r.name}.observed": r.observed for r in outcome.results if r.observed is not None})
    ctx.tracker.log_artifacts(run_id, ctx.run_dir / "verdict.json")
    ctx.tracker.end(run_id)
    log_evaluation_data(ctx)
    return outcome, evidence
