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
from kiln.pipeline.demo import prepare_demo_data
from kiln.pipeline.memory_plan import check_run
from kiln.pipeline.model_source import ResolvedModel
from kiln.pipeline.stages import RunContext


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
    """The prompts file a recipe names: 'demo' (kiln's demo prompts) or a local JSONL file."""
    return Path(prepare_demo_data().prompts) if spec == "demo" else Path(spec)


def read_prompts(spec: str, n: int, count_field: str = "evaluate.benchmark.num_prompts") -> list[str]:
    """The first `n` prompts of a JSONL file (one object with a 'prompt' string per line), or 'demo'."""
    path, field = prompts_path(spec), "evaluate.benchmark.prompts"
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


CONFIRMATION_PROMPTS = ("evaluate.benchmark.num_prompts (a search confirms its winner on the next num_prompts "
                        "prompts, which its screening did not run: the set needs twice num_prompts)")


def check_inputs(ctx: RunContext, model: ResolvedModel) -> None:
    """The recipe's input files, whether its engines can build the checkpoint and whether every arm
    fits in memory, checked before any stage runs: a bad one is refused in seconds, not after the
    optimize and engine stages."""
    ev = ctx.recipe.evaluate
    text_path(ev.quality.perplexity.text)
    read_prompts(ev.benchmark.prompts, ev.benchmark.num_prompts)
    if len(ctx.recipe.candidates or []) > 1 and not (ctx.recipe.search.objective or "").startswith(LOAD_PREFIX):
        read_prompts(ev.benchmark.prompts, 2 * ev.benchmark.num_prompts, CONFIRMATION_PROMPTS)
    if ev.quality.served:
        read_prompts(ev.benchmark.prompts, ev.quality.served.num_prompts, "evaluate.quality.served.num_prompts")
    check_backends(ctx.recipe, model.config)
    check_run(ctx.recipe, model.config)  # every arm's memory plan, before any stage loads a model


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
