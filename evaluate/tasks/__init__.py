"""lm-eval tasks for kiln: the shipped templates in this folder, users' task YAMLs, fingerprints.

Data files live in machine-specific places (the demo data cache), so each template names its
files as `${key}` and `render_shipped` writes a copy with the real paths, plus the derived data
files and the `!function` helpers, into a folder that lm-eval's `TaskManager` indexes. The paths
come in as an argument (`TaskData`: the orchestrator passes kiln.pipeline.demo.prepare's DemoData); this
package builds no data. `prepare_tasks` does that for the shipped names in a task list and finds
the folders of the user's YAMLs; `task_fingerprint` hashes what decides a task's numbers (config, data content,
lm-eval version), never its paths, so a cached baseline result is reused only when valid.

| task          | kind                    | data                                                    |
| ------------- | ----------------------- | ------------------------------------------------------- |
| heldout       | rolling perplexity      | `HELDOUT_DOCS` documents of >= `HELDOUT_DOC_CHARS` chars of the held-out text |
| word_swap     | 2-way multiple choice   | every word-swap item                                    |
| gsm8k_answer  | log-likelihood          | the first `GSM8K_DOCS` GSM8K reference solutions        |

Sizes keep each task to about a minute on the demo model with two idle CPU cores (~130 tokens/s).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import Any, Protocol

from kiln.core.errors import BadInput
from kiln.core.files import atomic_write_text, hash_of, sha256_file
from kiln.core.home import kiln_cache

HERE = Path(__file__).parent
SHIPPED = ("heldout", "word_swap", "gsm8k_answer")
NEEDS = {"heldout": "eval_text", "word_swap": "word_swap", "gsm8k_answer": "gsm8k_answers"}  # DemoData fields
HELPERS = "kiln_task_utils.py"
HELDOUT_DOCS, HELDOUT_DOC_CHARS, HELDOUT_MIN_WORDS = 16, 1500, 8  # ~6,500 demo-tokenizer tokens
GSM8K_DOCS = 50  # ~7,800 tokens
ADAPTER_VERSION = 1  # bump when KilnLM's tokenization or scoring changes what a task measures


class TaskData(Protocol):
    """The data files the shipped tasks read (kiln.pipeline.demo.prepare.DemoData has them)."""

    eval_text: Path
    word_swap: Path
    gsm8k_answers: Path


def needs_data(specs: list[str]) -> bool:
    """Whether a task list names a shipped task, which reads `TaskData`."""
    return any(s in SHIPPED for s in specs)


def template(name: str) -> Path:
    return HERE / f"{name}.yaml"


def heldout_documents(text: str) -> list[str]:
    """Consecutive prose paragraphs grouped into documents of at least HELDOUT_DOC_CHARS characters.

    Headings and other short lines ("Chapter 3") are dropped: they are not prose and repeat.
    """
    docs, current = [], []
    for para in (p.strip() for p in text.split("\n\n")):
        if len(para.split()) < HELDOUT_MIN_WORDS:
            continue
        current.append(para)
        if sum(len(p) for p in current) >= HELDOUT_DOC_CHARS:
            docs.append("\n\n".join(current))
            current = []
        if len(docs) == HELDOUT_DOCS:
            break
    return docs


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    # Unchanged files keep their mtime, so `datasets` reuses its Arrow cache instead of adding one.
    if not (path.is_file() and path.read_text(encoding="utf-8") == text):
        atomic_write_text(path, text)
    return path


def _data_files(names: list[str], data: TaskData, out: Path) -> dict[str, str]:
    """Files each template refers to; the derived ones are written under `out/data`."""
    for name in names:
        if not Path(getattr(data, NEEDS[name])).is_file():
            raise BadInput(f"lm-eval task {name}: data file {getattr(data, NEEDS[name])} not found. "
                           "Run `kiln prepare-demo` to build the demo data.")
    files: dict[str, str] = {}
    if "heldout" in names:
        docs = heldout_documents(Path(data.eval_text).read_text(encoding="utf-8"))
        rows = [{"id": f"heldout-{i:03d}", "text": d} for i, d in enumerate(docs)]
        files["heldout"] = str(_jsonl(out / "data" / "heldout.jsonl", rows))
    if "gsm8k_answer" in names:
        lines = Path(data.gsm8k_answers).read_text(encoding="utf-8").splitlines()[:GSM8K_DOCS]
        files["gsm8k_answers"] = str(_jsonl(out / "data" / "gsm8k_answers.jsonl", [json.loads(x) for x in lines]))
    if "word_swap" in names:
        files["word_swap"] = str(Path(data.word_swap).resolve())
    return files


def render_shipped(names: list[str], data: TaskData, out: Path) -> Path:
    """Write the named shipped tasks, ready for `TaskManager(include_path=out)`; returns `out`.

    `data` has the data paths (eval_text, word_swap, gsm8k_answers). Paths are written as JSON
    strings, which YAML reads verbatim.
    """
    unknown = sorted(set(names) - set(SHIPPED))
    if unknown:
        raise BadInput(f"Unknown shipped lm-eval task(s) {unknown}. Available: {', '.join(SHIPPED)}.")
    out = Path(out)
    files = {k: json.dumps(v) for k, v in _data_files(names, data, out).items()}
    for name in names:
        text = Template(template(name).read_text()).substitute(files)
        atomic_write_text(out / f"{name}.yaml", text)
    shutil.copyfile(HERE / HELPERS, out / HELPERS)
    return out


@dataclass(frozen=True)
class TaskSet:
    """Task names and the folders lm-eval's TaskManager must index to find them."""

    names: list[str]
    include_paths: list[Path]

    def fingerprints(self) -> dict[str, str]:
        return {name: task_fingerprint(name, self.include_paths) for name in self.names}


def prepare_tasks(specs: list[str], work_dir: Path, data: TaskData | None = None) -> TaskSet:
    """Render the shipped tasks named in `specs` into `work_dir`; locate the user YAMLs among them.

    `data`: the shipped tasks' data paths (kiln.pipeline.demo.prepare.prepare_demo_data() builds them);
    needed only when `specs` names a shipped task (`needs_data`).
    """
    shipped = [s for s in specs if s in SHIPPED]
    include: list[Path] = []
    if shipped:
        if data is None:
            raise BadInput(f"lm-eval task(s) {shipped}: kiln's shipped tasks read the demo data, and no data paths "
                           "were given. Pass data= (kiln.pipeline.demo.prepare.prepare_demo_data(), or any object with "
                           "eval_text, word_swap and gsm8k_answers paths).")
        include.append(render_shipped(shipped, data, Path(work_dir) / "shipped"))
    names = []
    for spec in specs:
        if spec in SHIPPED:
            names.append(spec)
            continue
        path = Path(spec).expanduser().resolve()
        names.append(_yaml_task_name(path))
        include.append(path.parent)
    if len(set(names)) != len(names):
        raise BadInput(f"evaluate.quality.lmeval.tasks: two tasks share a name ({names}). Rename one (`task:`).")
    return TaskSet(names, list(dict.fromkeys(include)))


def _yaml_task_name(path: Path) -> str:
    import yaml

    class Loader(yaml.SafeLoader):  # lm-eval's `!function` tag read as plain text: nothing is imported
        pass

    Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))
    where = f"evaluate.quality.lmeval.tasks: {path}"
    if not path.is_file():
        raise BadInput(f"{where} not found. Give the path of an lm-eval task YAML or a shipped task name.")
    try:
        cfg = yaml.load(path.read_text(), Loader=Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise BadInput(f"{where} is not valid YAML ({e}).") from e
    if not isinstance(cfg, dict) or not isinstance(cfg.get("task"), str):
        raise BadInput(f"{where} has no `task:` name. kiln runs single tasks; list a group's task YAMLs one by one.")
    return cfg["task"]


def offline_environment() -> None:
    """lm-eval and datasets must never reach a hub: kiln runs with local files only."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ.setdefault("HF_HOME", str(kiln_cache() / "hf"))


def task_manager(include_paths: list[Path]):
    """Only kiln's and the user's folders: indexing lm-eval's ~10k built-in tasks costs ~14 s."""
    offline_environment()
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[str(p) for p in include_paths], include_defaults=False)


def task_fingerprint(task: str, include_paths: list[Path]) -> str:
    """Hash of what decides a task's numbers: its config, with every file it names replaced by the
    file's content hash (so rendered paths don't matter), lm-eval's version and the adapter's."""
    from importlib.metadata import version

    entry = task_manager(include_paths).task_index.get(task)
    if entry is None or entry.cfg is None:
        raise BadInput(f"lm-eval task '{task}' not found in {[str(p) for p in include_paths]}.")
    return hash_of({"config": _content(entry.cfg), "lm_eval": version("lm_eval"), "adapter": ADAPTER_VERSION})


def _content(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _content(v) for k, v in value.items() if k != "config_source"}
    if isinstance(value, list):
        return [_content(v) for v in value]
    if isinstance(value, str) and os.sep in value:
        if Path(value).is_file():
            return {"sha256": sha256_file(Path(value))}
        module = Path(value.rsplit(".", 1)[0] + ".py")  # a resolved `!function` reference
        if "." in value and module.is_file():
            return {"function": value.rsplit(".", 1)[1], "module_sha256": sha256_file(module)}
    return value
