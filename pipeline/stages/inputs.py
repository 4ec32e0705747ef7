"""What the measuring stages read: the evaluation text, the prompts, their token ids (cached under
the tokenizer's files), the engines loaded on first use, and the check of all of it before any stage runs."""

from __future__ import annotations

import functools
import gc
import json
from pathlib import Path
from typing import Any

from kiln.core import yaml_input
from kiln.core.errors import BadInput
from kiln.core.files import atomic_write_json, hash_of, read_json, sha256_file
from kiln.core.metrics import LOAD_PREFIX
from kiln.pipeline.demo.prepare import prepare_demo_data
from kiln.pipeline.stages.memory_plan import check_run
from kiln.pipeline.recipe.model_source import ResolvedModel
from kiln.pipeline.stages.base import RunContext


def text_path(spec: str) -> Path:
    """The evaluation text a recipe names: 'demo' (kiln's held-out Austen text) or a local file."""
    if spec == "demo":
        return Path(prepare_demo_data().eval_text)
    path = Path(spec).expanduser()
    if not path.is_file():
        raise BadInput(f"evaluate.quality.perplexity.text: {spec} is not a file; give a local .txt file or 'demo'.")
    return path


class LazyEngines(dict):
    """Engines loaded on first use: a fully cached run loads no model at all."""

    def __init__(self, dirs: dict[str, Path], load: Any):
        super().__init__()
        self.dirs, self.load = dirs, load

    def __missing__(self, role: str) -> Any:
        self[role] = self.load(self.dirs[role])
        return self[role]

    def keep_only(self, role: str) -> None:
        """Close every engine this holds but `role`'s, before a stage that measures one arm: it then
        holds that arm's weights alone, from its start (the next stage that needs both loads the
        other again)."""
        for other in [r for r in self if r != role]:
            self.release(other)

    def release(self, role: str) -> None:
        """Close `role`'s engine and forget it: its memory goes back before the next load."""
        self.pop(role).close()
        gc.collect()  # an engine in a reference cycle would otherwise hold its weights until later

    def close(self) -> None:
        for engine in self.values():
            engine.close()


def tokenizer_of(engine_dir: Path) -> Any:
    """The tokenizer of the checkpoint the engine in `engine_dir` was built from."""
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


def tokenized_prompts(spec: str, n: int, tokenizer: Any,
                      count_field: str = "evaluate.benchmark.num_prompts") -> list[list[int]]:
    """The first `n` prompts of `spec` (see `read_prompts`), as `tokenizer`'s token ids."""
    return _encode(tokenizer, read_prompts(spec, n, count_field))


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def cached_prompts(ctx: RunContext, engine_dir: Path, spec: str, n: int,
                   count_field: str = "evaluate.benchmark.num_prompts") -> list[list[int]]:
    texts = read_prompts(spec, n, count_field)
    return token_ids(ctx, engine_dir, {"prompts": hash_of(texts)}, lambda tok: _encode(tok, texts))


def prompts_path(spec: str) -> Path:
    """The prompts file a recipe names: 'demo' (kiln's GSM8K questions), 'demo-copy' (its copy-heavy
    set: rewrite an Austen passage, fixing its typos) or a local JSONL file."""
    from kiln.pipeline.demo.copy_prompts import PROMPTS_SPEC

    if spec in ("demo", PROMPTS_SPEC):
        data = prepare_demo_data()
        return Path(data.prompts if spec == "demo" else data.copy_prompts)
    return Path(spec)


def read_prompts(spec: str, n: int, count_field: str = "evaluate.benchmark.num_prompts") -> list[str]:
    """The first `n` prompts of a JSONL file (one object with a 'prompt' string per line), or 'demo'."""
    path, field = prompts_path(spec), "evaluate.benchmark.prompts"
    if not path.is_file():
        raise BadInput(f"{field}: {path} not found; give a JSONL file with a 'prompt' field, 'demo' or 'demo-copy'.")
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


CONFIRMATION_PROMPTS = ("evaluate.benchmark.num_prompts (a search confirms its winner on the next num_prompts "
                        "prompts, which its screening did not run: the set needs twice num_prompts)")


def check_inputs(ctx: RunContext, model: ResolvedModel) -> None:
    """The recipe's input files, whether its engines can build the checkpoint and whether every arm
    fits in memory, checked before any stage runs: a bad one is refused in seconds, not after the
    optimize and engine stages. What loads nothing comes first: a checkpoint no machine here could hold
    is refused by its memory plan before its tokenizer is read to count the text's documents."""
    check_recipe_inputs(ctx.recipe, None, ctx.cache)
    check_backends(ctx.recipe, model.config)
    check_run(ctx.recipe, model.config)  # every arm's memory plan, before any stage loads a model
    perplexity = ctx.recipe.evaluate.quality.perplexity
    check_documents(text_path(perplexity.text), perplexity, model.path, ctx.cache)


def validate_inputs(recipe: Any) -> None:
    """`kiln validate`'s share of `check_inputs`: the model folder, whether its engines can build it, the
    files and counts; not the memory plan (`kiln plan-memory`), and the demo checkpoint only once converted."""
    from kiln.core.home import kiln_cache
    from kiln.pipeline.recipe.model_source import check_checkpoint, checkpoint_folder, demo_model_folder

    model = demo_model_folder(prepare=False) if recipe.model.path == "demo" else checkpoint_folder(recipe.model.path)
    if model is not None:
        check_backends(recipe, check_checkpoint(model))
    check_recipe_inputs(recipe, model, kiln_cache())


def check_recipe_inputs(recipe: Any, model_dir: Path | None, cache: Path) -> None:
    """Every file the recipe names and the counts its stages need from them, for `kiln run` (before any
    stage) and `kiln validate`: a bad one is BadInput naming the field and the fix. `model_dir`: the
    checkpoint whose tokenizer cuts the evaluation text into documents; None skips that count (the
    demo checkpoint before it is converted)."""
    ev = recipe.evaluate
    text = text_path(ev.quality.perplexity.text)
    read_prompts(ev.benchmark.prompts, ev.benchmark.num_prompts)
    if len(recipe.candidates or []) > 1 and not (recipe.search.objective or "").startswith(LOAD_PREFIX):
        read_prompts(ev.benchmark.prompts, 2 * ev.benchmark.num_prompts, CONFIRMATION_PROMPTS)
    if ev.quality.served:
        read_prompts(ev.benchmark.prompts, ev.quality.served.num_prompts, "evaluate.quality.served.num_prompts")
    _check_named_files(recipe)
    if model_dir is not None:
        check_documents(text, ev.quality.perplexity, model_dir, cache)


def _check_named_files(recipe: Any) -> None:
    """lm-eval task files, the load workload's prompts and each arm's calibration text."""
    from kiln.evaluate.perf.workload import load_prompts
    from kiln.optimize.calibration import resolve_dataset

    ev = recipe.evaluate
    for i, task in enumerate(ev.quality.lmeval.tasks if ev.quality.lmeval else []):
        if task.endswith((".yaml", ".yml")) and not Path(task).expanduser().is_file():
            raise BadInput(f"evaluate.quality.lmeval.tasks.{i}: {task} is not a file; give the path of an "
                           "lm-eval task YAML, or one of kiln's shipped task names.")
    if ev.load and ev.load.workload.dataset:
        load_prompts(ev.load.workload)
    for _, arm in recipe.arms():
        calibration = getattr(arm.optimize, "calibration", None)
        if calibration is not None and calibration.dataset != "demo":
            resolve_dataset(calibration.dataset)


def check_documents(text: Path, perplexity: Any, model_dir: Path, cache: Path) -> None:
    """The evaluation text yields the perplexity section's max_documents windows of seq_len tokens under
    the checkpoint's tokenizer (fewer were scored without a word)."""
    n = _token_count(text, model_dir, cache) // perplexity.seq_len
    if n < perplexity.max_documents:
        fix = (f"lower max_documents to {n} or seq_len" if n else "lower seq_len") + ", or give a longer text"
        raise BadInput(f"evaluate.quality.perplexity.max_documents: {text} yields {n} documents of "
                       f"{perplexity.seq_len} tokens (seq_len) under model.path's tokenizer, not "
                       f"{perplexity.max_documents}; {fix}.")


def _token_count(text: Path, model_dir: Path, cache: Path) -> int:
    """Tokens in `text` under the checkpoint's tokenizer, kept in the cache under the tokenizer's files and
    the text's bytes: a run whose stages are all reused loads no tokenizer for this."""
    from importlib.metadata import version

    key = hash_of({"tokenizer": _tokenizer_files_hash(str(model_dir)), "transformers": version("transformers"),
                   "text": sha256_file(text)})
    path = cache / "tokenized" / f"count-{key}.json"
    if path.exists():
        return int(read_json(path))
    ids = _tokenizer_at(str(model_dir))(text.read_text(), add_special_tokens=False, verbose=False)["input_ids"]
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, len(ids))
    return len(ids)


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
