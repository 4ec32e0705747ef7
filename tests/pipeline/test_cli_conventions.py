"""The command line's conventions (issue 54, point 3), over every command the `kiln` app has: `-h` is
`--help`, every option and argument says what it is for, help shows typer's metavars (TEXT, INTEGER,
PATH) and flows as sentences, one option name means one thing, `kiln --version`, and tables that keep
their cells whole without a terminal."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kiln.pipeline.cli.main import app
from tests.pipeline.conftest import fresh_cache, kiln, write_recipe


def _commands(group=None, path=()):
    """(path, click command) for every command and group of the app, the root included."""
    group = group or typer.main.get_command(app)
    yield path, group
    for name, sub in getattr(group, "commands", {}).items():
        yield from _commands(sub, (*path, name))


COMMANDS = list(_commands())
IDS = [" ".join(path) or "kiln" for path, _ in COMMANDS]


def _help(*args: str) -> str:
    r = CliRunner().invoke(app, [*args], env={"COLUMNS": "100"})
    assert r.exit_code == 0, r.output
    return r.output


@pytest.mark.parametrize("path, command", COMMANDS, ids=IDS)
def test_every_option_and_argument_says_what_it_is_for(path, command):
    missing = [p.name for p in command.params if not (getattr(p, "help", None) or "").strip()]
    assert not missing, f"kiln {' '.join(path)}: no help text for {missing}"


def test_no_two_options_share_a_help_text():
    """`route --upstream-api-key-env` read as `--api-key-env`: clients must send it (upstreams get it)."""
    for path, command in COMMANDS:
        helps = [p.help for p in command.params if getattr(p, "help", None)]
        assert len(helps) == len(set(helps)), f"kiln {' '.join(path)}: two options with one help text"


def test_one_option_name_means_one_thing_across_commands():
    """`--fresh` was a repeatable list of stages in `run` and a flag in `tune`."""
    kinds: dict[str, set[tuple[bool, bool]]] = {}
    for _, command in COMMANDS:
        for p in command.params:
            for opt in p.opts:
                if opt.startswith("--"):
                    kinds.setdefault(opt, set()).add((bool(getattr(p, "is_flag", False)), bool(p.multiple)))
    assert {opt: k for opt, k in kinds.items() if len(k) > 1} == {}


@pytest.mark.parametrize("path, command", COMMANDS, ids=IDS)
def test_dash_h_is_help_and_shows_typer_metavars(path, command):
    short, long = _help(*path, "-h"), _help(*path, "--help")
    assert short == long and "Usage: " in short
    assert not re.search(r"<(str|int|float|bool|path|list\[[a-z]+\])>", short), short


def test_help_sentences_do_not_break_at_the_source_lines():
    """Docstring line breaks went through to --help ("to quantize, to⏎ serve")."""
    text = _help("plan-memory", "-h")
    flowing = " ".join(text.split())
    assert "one line each) to quantize, to serve, to run" in flowing
    lines = [line.strip(" │") for line in text.splitlines()]
    assert not any(line.endswith(" to") and len(line) < 60 for line in lines), text
    assert "PATH" in text and "INTEGER" in text and "TEXT" in text


def test_version():
    r = subprocess.run([sys.executable, "-m", "kiln.pipeline", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == f"kiln {version('kiln')}", r.stdout + r.stderr


def _fake_run(runs: Path, name: str, verdict: str = "Successful") -> Path:
    """A finished run's folder as `kiln run` leaves it, as far as `runs` and `show` read it."""
    d = runs / name
    (d / "stages").mkdir(parents=True)
    (d / "state.json").write_text(json.dumps({"status": "done", "verdict": verdict, "exit_code": 0}))
    (d / "stages" / "quality-candidate.json").write_text(json.dumps(
        {"stage": "quality", "role": "candidate", "reused": False, "metrics": {"perplexity": 12.5}}))
    (d / "report.md").write_text("# report\n")
    return d


def test_tables_keep_their_cells_whole_without_a_terminal(tmp_path, monkeypatch):
    """A CI log cut `plan-memory`'s table to 80 columns ("opti…"); here stdout is a pipe. (pytest-xdist's
    workers export COLUMNS=80, which kiln rightly obeys: unset here, as a CI runner has it.)"""
    name = "20261201-120000-" + "a-long-recipe-name-" * 4
    _fake_run(tmp_path / "runs", name, verdict="Inconclusive (the interval straddles the bar)")
    monkeypatch.delenv("COLUMNS", raising=False)
    r = kiln("runs", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert name in r.stdout and "Inconclusive (the interval straddles the bar)" in r.stdout and "…" not in r.stdout


def test_runs_and_show_json(tmp_path):
    _fake_run(tmp_path / "runs", "r1")
    r = kiln("runs", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert [(s["run"], s["verdict"], s["exit_code"]) for s in json.loads(r.stdout)] == [("r1", "Successful", 0)]
    r = kiln("show", "r1", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    shown = json.loads(r.stdout)
    assert shown["run"] == "r1" and shown["state"]["verdict"] == "Successful" and shown["report_md"] == "# report\n"
    assert shown["stages"][0]["metrics"] == {"perplexity": 12.5}
    assert kiln("runs", cwd=tmp_path).stdout.lstrip()[:1] != "["  # human text stays the default


def test_validate_json(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_model_dir)
    r = kiln("validate", str(recipe), "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["valid"] is True and doc["name"] == "tiny" and doc["arms"][0]["optimize"] == "int8_weight_only"
    r = kiln("validate", str(recipe), "--json", "--set", "evaluate.benchmark.num_prompts=0", cwd=tmp_path)
    assert r.returncode == 2 and json.loads(r.stdout)["valid"] is False, r.stdout + r.stderr


def test_plan_memory_json(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_model_dir)
    r = kiln("plan-memory", str(recipe), "--json", "--available", "64G", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    arms = json.loads(r.stdout)["arms"]
    assert set(arms) == {"baseline", "candidate"} and arms["candidate"]["fits"] is True
    assert arms["candidate"]["steps"]["serve"]["total_bytes"] > 0


def test_cache_list_json(tmp_path):
    cache = fresh_cache(tmp_path / "cache")
    r = kiln("cache", "list", "--json", "--tracking-uri", f"sqlite:///{tmp_path / 'none.db'}", cwd=tmp_path,
             env={"KILN_CACHE": str(cache)})
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["root"] == str(cache) and doc["entries"] == [] and doc["total_bytes"] >= 0


def _lines(n: int) -> str:
    return "".join(json.dumps({"prompt": f"question {i}?"}) + "\n" for i in range(n))


@pytest.mark.parametrize("change, field", [
    ({"model": {"path": "MISSING/my-fine-tune"}}, "model.path: "),
    ({"evaluate__quality__perplexity__text": "MISSING/eval.txt"}, "evaluate.quality.perplexity.text: "),
    ({"evaluate__benchmark__prompts": "MISSING/prompts.jsonl"}, "evaluate.benchmark.prompts: "),
    ({"evaluate__benchmark__prompts": "TMP/five.jsonl", "evaluate__benchmark__num_prompts": 8},
     "has 5 rows with a 'prompt' string; evaluate.benchmark.num_prompts asks for 8"),
    ({"evaluate__quality__perplexity__text": "TMP/short.txt", "evaluate__quality__perplexity__max_documents": 12},
     "evaluate.quality.perplexity.max_documents: "),
    ({"evaluate__quality__lmeval": {"tasks": ["word_swap", "MISSING/task.yaml"]}}, "evaluate.quality.lmeval.tasks.1: "),
], ids=["model-folder", "eval-text", "prompt-set", "prompt-count", "documents", "task-file"])
def test_validate_checks_what_the_recipe_names(change, field, tmp_path, tiny_model_dir):
    """`kiln validate` passed these; only `kiln run` refused them."""
    (tmp_path / "five.jsonl").write_text(_lines(5))
    (tmp_path / "short.txt").write_text("Only a few words of text, far fewer than twelve windows of 128 tokens.\n")
    change = json.loads(json.dumps(change).replace("TMP", str(tmp_path)).replace("MISSING", str(tmp_path / "gone")))
    recipe = write_recipe(tmp_path / "r.yaml", tiny_model_dir, **change)
    r = kiln("validate", str(recipe), cwd=tmp_path)
    assert r.returncode == 2 and field in " ".join(r.stderr.split()), r.stdout + r.stderr
