"""How CI reviews a pull request's recipe: `kiln policy diff` (each difference of two policies,
stricter, looser or changed), and `kiln run/validate --policy-from` (the base branch's policy judges).

The classification is pure (kiln.pipeline.recipe.policy): tested on the policies of real recipes, edited
as a pull request would edit them.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kiln.pipeline.recipe.policy import (CHANGED, LOOSER, STRICTER, overall, policy, policy_changes, policy_digest,
                                  policy_overrides)
from kiln.pipeline.recipe.schema import Recipe, load_recipe

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "recipes" / "demo-int8.yaml"


def raw() -> dict:
    return yaml.safe_load(DEMO.read_text())


def edited(edit) -> dict:
    """The policy of demo-int8.yaml after `edit(raw_recipe)`."""
    data = copy.deepcopy(raw())
    edit(data)
    return policy(Recipe.model_validate(data))


def changes(edit) -> dict[str, str]:
    return {c.path: c.direction for c in policy_changes(policy(load_recipe(DEMO)), edited(edit))}


def check(data: dict, metric: str) -> dict:
    return next(c for c in data["gate"]["checks"] if c.get("metric", "size_bytes") == metric)


def test_identical_policies_have_no_changes() -> None:
    assert policy_changes(policy(load_recipe(DEMO)), edited(lambda d: d.update(name="renamed"))) == []
    assert overall([]) == "identical"


def test_reordered_checks_are_the_same_policy() -> None:
    assert changes(lambda d: d["gate"]["checks"].reverse()) == {}


@pytest.mark.parametrize(("edit", "want"), [
    # the attacks of issue 52: a margin raised, a check dropped, undecided let through
    (lambda d: check(d, "perplexity").update(margin=0.5), {"gate.checks[quality:perplexity].margin": LOOSER}),
    (lambda d: check(d, "perplexity").update(margin=0.01), {"gate.checks[quality:perplexity].margin": STRICTER}),
    (lambda d: d["gate"]["checks"].remove(check(d, "perplexity")), {"gate.checks[quality:perplexity]": LOOSER}),
    (lambda d: d["gate"].update(on_inconclusive="pass"), {"gate.on_inconclusive": LOOSER}),
    (lambda d: d["gate"].update(confidence=0.8), {"gate.confidence": LOOSER}),
    (lambda d: d["gate"].update(confidence=0.99), {"gate.confidence": STRICTER}),
    (lambda d: d["gate"]["checks"].append({"kind": "agreement", "metric": "kl_mean", "max": 0.1}),
     {"gate.checks[agreement:kl_mean]": STRICTER}),
    (lambda d: check(d, "size_bytes").update(max_ratio=0.9), {"gate.checks[size:size_bytes].max_ratio": LOOSER}),
    (lambda d: check(d, "decode_tok_s").update(min_ratio=0.5),
     {"gate.checks[performance:decode_tok_s].min_ratio": LOOSER}),
    (lambda d: check(d, "decode_tok_s").update(min_ratio=9.0),
     {"gate.checks[performance:decode_tok_s].min_ratio": STRICTER}),
    (lambda d: check(d, "decode_tok_s").update(max_cpu_pressure=None),
     {"gate.checks[performance:decode_tok_s].max_cpu_pressure": LOOSER}),  # the contention guard off
    (lambda d: check(d, "decode_tok_s").update(max_cpu_pressure=0.9),
     {"gate.checks[performance:decode_tok_s].max_cpu_pressure": LOOSER}),
    (lambda d: check(d, "perplexity").update(relative=False), {"gate.checks[quality:perplexity].relative": CHANGED}),
    # what is measured: fewer documents, prompts, rounds is looser; a data file changed, unknown which way
    (lambda d: d["evaluate"]["quality"]["perplexity"].update(max_documents=4),
     {"evaluate.quality.perplexity.max_documents": LOOSER}),
    (lambda d: d["evaluate"]["benchmark"].update(repeats=9), {"evaluate.benchmark.repeats": STRICTER}),
    (lambda d: d["evaluate"]["benchmark"].update(num_prompts=2), {"evaluate.benchmark.num_prompts": LOOSER}),
    (lambda d: d["evaluate"]["quality"]["perplexity"].update(text="data/easy.txt"),
     {"evaluate.quality.perplexity.text": CHANGED}),
    (lambda d: d["evaluate"]["quality"]["lmeval"].update(limit=20), {"evaluate.quality.lmeval.limit": LOOSER}),
    (lambda d: d["evaluate"]["quality"]["lmeval"].update(tasks=["word_swap", "heldout"]),
     {"evaluate.quality.lmeval.tasks": CHANGED}),
    (lambda d: (d["evaluate"]["quality"].pop("lmeval"), d["gate"]["checks"].remove(check(d, "word_swap_acc"))),
     {"evaluate.quality.lmeval": LOOSER, "gate.checks[quality:word_swap_acc]": LOOSER}),
    # what it is judged against
    (lambda d: d.update(baseline={"engine": {"backend": "torch", "threads": 1}}), {"baseline.engine": CHANGED}),
], ids=lambda v: "" if callable(v) else ",".join(f"{k}={d}" for k, d in v.items()))
def test_each_change_is_classified(edit, want: dict[str, str]) -> None:
    assert changes(edit) == want


def test_a_measurement_switched_off_is_looser() -> None:
    """On policies as data (a recipe that measures no agreement may not gate on it, so it is no recipe)."""
    before = policy(load_recipe(DEMO))
    after = copy.deepcopy(before)
    after["evaluate"]["quality"]["agreement"] = False
    assert [(c.path, c.direction) for c in policy_changes(before, after)] == [("evaluate.quality.agreement", LOOSER)]
    assert [c.direction for c in policy_changes(after, before)] == [STRICTER]


def test_a_lmeval_limit_removed_measures_every_document() -> None:
    before = edited(lambda d: None)
    after = edited(lambda d: d["evaluate"]["quality"]["lmeval"].pop("limit"))
    assert [(c.path, c.old, c.new, c.direction) for c in policy_changes(before, after)] == [
        ("evaluate.quality.lmeval.limit", 200, None, STRICTER)]


def test_overall_is_the_weakest_change() -> None:
    def both(d: dict) -> None:
        d["gate"].update(confidence=0.99)
        check(d, "perplexity").update(margin=0.5)

    found = policy_changes(policy(load_recipe(DEMO)), edited(both))
    assert overall(found) == LOOSER
    assert overall([c for c in found if c.direction == STRICTER]) == STRICTER
    text = edited(lambda d: d["evaluate"]["quality"]["perplexity"].update(text="data/x.txt"))
    assert overall(policy_changes(policy(load_recipe(DEMO)), text)) == CHANGED


def test_a_check_whose_kind_or_metric_changed_is_one_removed_and_one_added() -> None:
    found = changes(lambda d: check(d, "top1_agreement").update(metric="kl_mean", min=None, max=0.1))
    assert found == {"gate.checks[agreement:top1_agreement]": LOOSER, "gate.checks[agreement:kl_mean]": STRICTER}


def test_policy_overrides_are_the_policy_fields_of_set() -> None:
    sets = ["gate.confidence=0.9", "evaluate.benchmark.repeats=5", "baseline={engine: {backend: torch}}",
            "engine.threads=1", "name=x"]
    assert policy_overrides(sets) == sets[:3]


# --- the commands ------------------------------------------------------------------------------------


def kiln(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln.pipeline", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def write(path: Path, edit) -> Path:
    data = raw()
    edit(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_policy_diff_exit_codes_and_json(tmp_path: Path) -> None:
    same = write(tmp_path / "same.yaml", lambda d: d.update(name="same"))
    proc = kiln("policy", "diff", str(DEMO), str(same))
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("identical"), proc.stdout + proc.stderr

    stricter = write(tmp_path / "stricter.yaml", lambda d: d["gate"].update(confidence=0.99))
    proc = kiln("policy", "diff", str(DEMO), str(stricter))
    assert proc.returncode == 0 and "stricter gate.confidence: 0.95 -> 0.99" in " ".join(proc.stdout.split())

    looser = write(tmp_path / "looser.yaml", lambda d: d["gate"].update(on_inconclusive="pass"))
    proc = kiln("policy", "diff", str(DEMO), str(looser), "--json")
    assert proc.returncode == 1, proc.stdout + proc.stderr  # needs approval: CI tells it by the code
    out = json.loads(proc.stdout)
    assert out["outcome"] == LOOSER and out["needs_approval"] is True
    assert out["changes"] == [{"path": "gate.on_inconclusive", "old": "fail", "new": "pass", "direction": LOOSER}]
    assert out["old"]["sha256"] == policy_digest(load_recipe(DEMO)) != out["new"]["sha256"]

    data = write(tmp_path / "data.yaml", lambda d: d["evaluate"]["benchmark"].update(prompts="easy.jsonl"))
    assert kiln("policy", "diff", str(DEMO), str(data)).returncode == 1  # changed, unknown which way

    proc = kiln("policy", "diff", str(DEMO), str(tmp_path / "missing.yaml"))
    assert proc.returncode == 2 and "missing.yaml" in proc.stderr


def test_validate_policy_from_judges_under_the_other_recipe(tmp_path: Path) -> None:
    weakened = write(tmp_path / "weakened.yaml", lambda d: d["gate"].update(
        on_inconclusive="pass", checks=[{"kind": "quality", "metric": "perplexity", "margin": 9.0}]))
    proc = kiln("validate", str(weakened), "--policy-from", str(DEMO))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = " ".join(proc.stdout.split())
    assert f"judged under the policy of {DEMO} (policy {policy_digest(load_recipe(DEMO))[:12]})" in text
    assert f"{len(raw()['gate']['checks'])} gate checks" in text  # the base's checks, not the one left
    assert "judged under" not in kiln("validate", str(weakened)).stdout
    proc = kiln("validate", str(weakened), "--policy-from", str(tmp_path / "nope.yaml"))
    assert proc.returncode == 2 and "nope.yaml" in proc.stderr
