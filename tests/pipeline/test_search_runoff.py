"""The search picks among the candidates that passed from measurements taken at one moment.

Each candidate's screening ratio is over the baseline as it ran at that candidate's own benchmark,
minutes or reruns apart, and a reused stage is from an earlier run: at 135M the search picked
OpenVINO on 2.96x against q8_0's 2.80x, q8_0's measured in an earlier run, while side by side q8_0
decoded faster. So the leader at screening meets every candidate not shown slower there, both
engines interleaved in one fresh stage, and the faster on the paired ratio is the one confirmed.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import mlflow
import pytest
import yaml

from kiln.core.gate.base import Evidence
from kiln.pipeline.search import search
from kiln.pipeline.search.search import Arm
from tests.pipeline.conftest import TINY_RECIPE, kiln


def _arm(name: str, ratio: float, low: float, high: float, engine: Path, reused: bool = False) -> Arm:
    """An arm whose screening benchmark (stages/benchmark-pair.json) this run measured, or reused."""
    printed: list[str] = []
    run_dir = engine.parent / f"run-{name}"
    (run_dir / "stages").mkdir(parents=True)
    (run_dir / "stages" / "benchmark-pair.json").write_text(json.dumps({"stage": "benchmark", "reused": reused}))
    ctx = SimpleNamespace(recipe=SimpleNamespace(search=SimpleNamespace(objective="decode_tok_s")), run_dir=run_dir,
                          console=SimpleNamespace(print=lambda text, **_: printed.append(text)), printed=printed)
    arm = Arm(name, ctx, f"run-{name}")  # type: ignore[arg-type]
    arm.screened = {"ratio": ratio, "low": low, "high": high, "pairs": 8, "confidence": 0.98}
    arm.engines = {"candidate": engine}
    return arm


@pytest.fixture
def paired(monkeypatch):
    """`_paired` answering with the decode rates each engine is given here, as one interleaved stage would."""
    rates: dict[Path, list[float]] = {}
    met: list[tuple[str, str]] = []

    def fake(arm, folder, engines, shared, policy, say, held_out):
        met.append((engines["baseline"].name, engines["candidate"].name))
        assert held_out is False  # the runoff runs the screening's prompts: the confirmation's stay held out
        return {role: Evidence(role, repeats={"decode_tok_s": rates[path]}) for role, path in engines.items()}

    monkeypatch.setattr(search, "_paired", fake)
    return SimpleNamespace(rates=rates, met=met)


def test_the_runoff_overturns_a_screening_taken_at_different_moments(tmp_path, paired):
    ov, q8, slow = (tmp_path / n for n in ("ov", "q8", "slow"))
    for p in (ov, q8, slow):
        p.mkdir()
    # Screening: ov ahead; q8's interval reaches ov's; slow is shown slower than ov.
    arms = [_arm("q8", 2.80, 2.68, 2.92, q8), _arm("ov", 2.96, 2.85, 3.10, ov), _arm("slow", 1.2, 1.1, 1.3, slow)]
    paired.rates.update({ov: [140.0, 144.0, 139.0, 150.0], q8: [180.0, 190.0, 176.0, 200.0], slow: [1.0, 1.0]})
    policy = SimpleNamespace(confidence=0.98)
    winner = search._runoff(arms, shared={}, policy=policy)
    assert winner.name == "q8"
    assert paired.met == [("ov", "q8")]  # slow never met anyone: its screening already showed it slower
    fig = arms[0].runoff
    assert fig["against"] == "ov" and fig["ratio"] == pytest.approx((180 * 190 * 176 * 200 / (140 * 144 * 139 * 150)) ** 0.25)
    assert fig["low"] < fig["ratio"] < fig["high"] and fig["pairs"] == 4
    assert arms[1].runoff is None and arms[2].runoff is None


def test_the_leader_stays_when_the_runoff_shows_it_faster_and_the_next_meets_the_leader(tmp_path, paired):
    a, b, c = (tmp_path / n for n in "abc")
    for p in (a, b, c):
        p.mkdir()
    arms = [_arm("a", 3.0, 2.8, 3.2, a), _arm("b", 2.9, 2.7, 3.1, b), _arm("c", 2.95, 2.75, 3.15, c)]
    paired.rates.update({a: [100.0, 101.0, 99.0], b: [90.0, 91.0, 89.0], c: [110.0, 111.0, 109.0]})
    winner = search._runoff(arms, shared={}, policy=SimpleNamespace(confidence=0.98))
    # by screening a, c, b: c meets a and leads on, then b meets c
    assert paired.met == [("a", "c"), ("c", "b")] and winner.name == "c"
    assert arms[2].runoff["against"] == "a" and arms[1].runoff["against"] == "c" and arms[1].runoff["ratio"] < 1


def test_a_screening_reused_from_an_earlier_run_is_not_trusted_to_leave_a_candidate_out(tmp_path, paired):
    """135M, 2026-12-06 02:30: q8_0's screening (3.47x, reused from 01:58) led q4_1's fresh 2.83x; the
    machine had slowed by half between. Shown slower or not, a reused figure does not decide alone."""
    q8, q41, ov = (tmp_path / n for n in ("q8", "q41", "ov"))
    for p in (q8, q41, ov):
        p.mkdir()
    arms = [_arm("q8", 3.47, 3.30, 3.60, q8, reused=True), _arm("q41", 2.83, 2.48, 3.22, q41),
            _arm("ov", 2.0, 1.9, 2.1, ov)]
    paired.rates.update({q8: [100.0, 104.0, 98.0], q41: [125.0, 128.0, 121.0], ov: [90.0, 91.0, 92.0]})
    winner = search._runoff(arms, shared={}, policy=SimpleNamespace(confidence=0.98))
    # ov is shown slower than q8 only by q8's reused figure: it meets q8, then q41 leads; ov and q41
    # both measured this run, ov shown slower: left out
    assert paired.met == [("q8", "q41")] and winner.name == "q41", paired.met
    fresh = [_arm("a", 3.0, 2.9, 3.1, tmp_path / "a"), _arm("b", 2.0, 1.9, 2.1, tmp_path / "b", reused=True)]
    for arm in fresh:
        arm.engines["candidate"].mkdir()
    paired.met.clear()
    paired.rates.update({tmp_path / "a": [3.0, 3.1], tmp_path / "b": [2.0, 2.1]})
    assert search._runoff(fresh, shared={}, policy=SimpleNamespace(confidence=0.98)).name == "a"
    assert paired.met == [("a", "b")]  # b's reused figure shows it slower: measured beside a anyway


def test_engines_on_other_machines_are_picked_by_screening_and_said_so(tmp_path, paired):
    here = tmp_path / "here"
    here.mkdir()
    arms = [_arm("here", 2.0, 1.8, 2.2, here), _arm("there", 2.1, 1.9, 2.3, tmp_path / "on-another-node")]
    winner = search._runoff(arms, shared={}, policy=SimpleNamespace(confidence=0.98))
    assert winner.name == "there" and paired.met == []
    assert any("not both on this machine; picked by screening" in t for t in arms[1].ctx.printed)


CANDIDATES = [  # the same weights on the same engine: both pass, and their true speeds are equal
    {"name": "copy-a", "optimize": {"method": "none"}, "engine": {"backend": "torch", "threads": 2}},
    {"name": "copy-b", "optimize": {"method": "none"},
     "engine": {"backend": "torch", "threads": 2, "score_batch_tokens": 2048}},  # scoring only: decode unchanged
]


@pytest.fixture(scope="module")
def runoff_run(tmp_path_factory, tiny_model_dir):
    work = tmp_path_factory.mktemp("runoff")
    raw = yaml.safe_load(yaml.safe_dump(TINY_RECIPE))
    del raw["optimize"], raw["engine"]
    raw.update(name="tiny-runoff", model={"path": str(tiny_model_dir)}, candidates=CANDIDATES)
    raw["evaluate"]["quality"].update(lmeval=None, agreement=False)
    raw["evaluate"]["quality"]["perplexity"]["max_documents"] = 24
    # The speed bound is the checkpoint's; on a busy CI host it must not turn Inconclusive (test_search.py):
    # neither guard, CPU pressure nor steal (a fresh CI VM's steal moved between a pair's halves).
    raw["gate"]["checks"] = [{"kind": "quality", "metric": "perplexity", "margin": 0.05, "relative": True},
                             {"kind": "performance", "metric": "decode_tok_s", "min_ratio": 0.1,
                              "max_cpu_pressure": None, "max_cpu_steal": None}]
    recipe = work / "runoff.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    proc = kiln("run", str(recipe), cwd=work)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"work": work, "recipe": recipe, "run_dir": next((work / "runs").iterdir()), "proc": proc}


def _checks(work: Path) -> str:
    """The newest run's checks, each with its verdict and reason: why a run did not pass."""
    verdict = json.loads((max((work / "runs").iterdir(), key=lambda p: p.stat().st_mtime) / "verdict.json").read_text())
    return "\n".join(f"{c['name']}: {c['verdict']}: {c.get('reason', '')}" for c in verdict.get("checks", [])) + "\n"


def _stage(path: Path) -> tuple[dict, dict]:
    pointer = json.loads(path.read_text())
    return pointer, json.loads((Path(pointer["path"]) / "manifest.json").read_text())


def test_two_passing_candidates_meet_in_a_fresh_interleaved_stage(runoff_run):
    run_dir = runoff_run["run_dir"]
    record = json.loads((run_dir / "search.json").read_text())
    rows = {c["name"]: c for c in record["candidates"]}
    assert all(c["eliminated"] is None and c["screened"] for c in rows.values()), rows
    leader = max(rows.values(), key=lambda c: c["screened"]["ratio"])
    [rival] = [c for c in rows.values() if c is not leader]
    fig = rival["runoff"]
    assert fig is not None and fig["against"] == leader["name"] and fig["pairs"] >= 2, rival
    # the rival wins only where the paired ratio shows it faster (a tie keeps the leader), and the winner
    # was measured again (held out) after it was picked
    assert record["winner"] == (rival["name"] if fig["low"] > 1 else leader["name"])
    assert rows[record["winner"]]["confirmed"] is not None
    folder = run_dir / "candidates" / rival["name"] / f"runoff-{leader['name']}" / "stages"
    _, manifest = _stage(folder / "benchmark-pair.json")
    inputs = manifest["inputs"]
    client = mlflow.MlflowClient(f"sqlite:///{runoff_run['work'] / 'mlflow.db'}")
    [logged] = client.search_runs([client.get_experiment_by_name("kiln-test").experiment_id],
                                  f"tags.`kiln.candidate` = '{rival['name']}' and tags.`kiln.stage` = 'candidate'")
    assert logged.data.metrics["runoff_speedup.ratio"] == pytest.approx(fig["ratio"])
    # keyed by this run (its candidate's MLflow run), so never reused; not the confirmation's held-out prompts
    assert inputs["fresh"] == {"run": logged.info.run_id} and "confirmation" not in inputs
    # both candidates' engines, neither the baseline's, on the prompts the screening ran (the winner's
    # benchmark-pair is now its confirmation, on held-out prompts: the other's is its screening)
    _, screening = _stage(run_dir / "candidates" / rival["name"] / "stages" / "benchmark-pair.json")
    _, theirs = _stage(run_dir / "candidates" / leader["name"] / "stages" / "benchmark-pair.json")
    [screened] = [m for m in (screening, theirs) if "confirmation" not in m["inputs"]]
    assert inputs["prompts"] == screened["inputs"]["prompts"]
    assert inputs["engines"] == {"baseline": theirs["inputs"]["engines"]["candidate"],
                                 "candidate": screening["inputs"]["engines"]["candidate"]}
    assert len(set(inputs["engines"].values())) == 2
    report = (run_dir / "report.md").read_text()
    assert f"against {leader['name']} at one moment" in report
    assert "measured beside it at one moment (runoff)" in record["why"]


def test_a_rerun_measures_the_runoff_again(runoff_run):
    """A runoff compares candidates at one moment: a rerun's is this run's, never an earlier one's."""
    second = kiln("run", str(runoff_run["recipe"]), cwd=runoff_run["work"])
    assert second.returncode == 0, _checks(runoff_run["work"]) + second.stdout[-3000:] + second.stderr[-3000:]
    computed = [line for line in second.stdout.splitlines() if "▶" in line and "benchmark[pair]" in line]
    assert len(computed) == 2, computed  # the runoff and the winner's confirmation; the screenings reused


def test_every_phase_has_the_words_the_console_says_it_with():
    """The line after each phase names it (`SAID`): a phase added without words would stop the search."""
    from kiln.pipeline.stages.phases import PHASES
    from kiln.pipeline.search.search import SAID

    assert set(SAID) == set(PHASES)


def test_a_runoff_that_cannot_tell_the_two_apart_keeps_the_leader_and_says_so(tmp_path, paired):
    """A paired ratio whose interval holds 1 is a tie: the leader at screening stays (noise does not move
    the pick between runs) and the report says the two were not told apart, not that one was faster."""
    from kiln.pipeline.report.report import _picked_over, _runoff as runoff_note

    a, b = tmp_path / "a", tmp_path / "b"
    for p in (a, b):
        p.mkdir()
    arms = [_arm("a", 3.0, 2.8, 3.2, a), _arm("b", 2.95, 2.75, 3.15, b)]
    paired.rates.update({a: [100.0, 104.0, 97.0, 101.0], b: [103.0, 99.0, 102.0, 100.0]})  # b/a: 1.005, wide
    winner = search._runoff(arms, shared={}, policy=SimpleNamespace(confidence=0.98))
    fig = arms[1].runoff
    assert fig["low"] < 1 < fig["high"] and fig["ratio"] > 1, fig  # b's point estimate is ahead, not shown so
    assert winner.name == "a"
    assert runoff_note(fig).endswith("(not told apart)")
    said = _picked_over(arms, winner)
    assert "not told apart from b" in said and "faster than" not in said, said
