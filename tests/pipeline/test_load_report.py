"""`kiln run` with an `evaluate.load` sweep on the tiny model: the load stage and the full report."""

import base64
import json
import re
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.pipeline.conftest import kiln, write_recipe

LOAD = {"shape": {"kind": "sweep", "steps": 2, "max_concurrency": 4}, "duration_s": 1.5,
        "warmup": {"seconds": 0.3}, "cooldown": {"seconds": 0.2}, "output_tokens": 8,
        "workload": {"input_tokens": {"mean": 16}}, "price_per_hour": 1.5, "repeats": 1,
        "prefix": {"requests": 4, "user_tokens": 8, "output_tokens": 2}}


@pytest.fixture(scope="module")
def load_run(tmp_path_factory, tiny_model_dir):
    work = tmp_path_factory.mktemp("load-run")
    recipe = write_recipe(
        work / "load.yaml", tiny_model_dir, name="tinyload",
        evaluate__quality={"perplexity": {"text": "demo", "max_documents": 6, "seq_len": 64}, "agreement": True},
        evaluate__benchmark={"prompts": "demo", "num_prompts": 2, "max_new_tokens": 4, "repeats": 2},
        evaluate__load=LOAD,
        gate={"checks": [{"kind": "quality", "metric": "perplexity", "margin": 0.05, "relative": True},
                         {"kind": "agreement", "metric": "top1_agreement", "min": 0.5},
                         {"kind": "error_rate", "max": 0.05}]})
    proc = kiln("run", str(recipe), cwd=work)
    assert proc.returncode in (0, 1, 3), proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = next((work / "runs").iterdir())
    stage = json.loads((run_dir / "stages" / "load-pair.json").read_text())
    return {"work": work, "run_dir": run_dir, "stage": stage, "path": Path(stage["path"]),
            "result": json.loads((Path(stage["path"]) / "result.json").read_text())}


def test_load_stage_records_metrics_knee_and_plots(load_run):
    path, result = load_run["path"], load_run["result"]
    for role in ("baseline", "candidate"):
        rows = [json.loads(line) for line in (path / "records" / f"{role}-r0.jsonl").read_text().splitlines()]
        assert {r["stage"] for r in rows} >= {"synchronous", "throughput@4"} and len({r["stage"] for r in rows}) == 4
        # Every request answered. One exception is the client's definition, not a failure: it times the
        # first visible text (as other load tools do), and the random tiny model can answer 8 tokens that
        # render none (request r0s1-195 of the throughput stage, reached when the machine sends 196 in
        # its 1.5 s: both fresh-clone CI runs of 2026-12-05); usage still counts its tokens.
        unanswered = [r for r in rows if r["error"] is not None
                      and not (r["error"] == "no output tokens in the stream" and r["output_tokens"] > 0)]
        assert not unanswered, unanswered[:3]
        part = result["per_role"][role]
        m = part["metrics"]
        assert 0 < m["load_ttft_p50_ms"] <= m["load_ttft_p95_ms"] and m["load_tpot_p50_ms"] > 0
        assert m["load_output_token_throughput"] > 0 and m["load_cost_per_1m_output_tokens"] > 0
        assert part["repeats"]["load_e2e_p50_ms"] == [m["load_e2e_p50_ms"]]  # one repeat
        assert part["counts"]["error_rate"][0] == 0 and part["counts"]["error_rate"][1] == len(rows) or \
            part["counts"]["error_rate"][1] <= len(rows)
        assert len(part["stages"]) == 4
        # the knee (when the curve has one) is one of the open-loop rates that were run
        if part["knee"]:
            assert part["knee"]["rate"] in [s["target_rate"] for s in part["stages"] if s["target_rate"]]
            assert m["load_knee_rate"] == part["knee"]["rate"]
        else:  # no knee on a noisy machine: no knee metric, and the headline falls back to the last stage
            assert "load_knee_rate" not in m and part["headline"] == part["stages"][-1]["label"]
        measured = [r for r in part["roofline"] if r["measured_tpot_ms"]]
        assert {r["batch"] for r in measured} == {1, 4}  # synchronous and the 4-user probe
        assert all(r["mbu"] == pytest.approx(r["step_ms"] / r["measured_tpot_ms"]) for r in measured)
        assert f"{role}.load_tpot_p50_ms" in result["metrics"]
        # The prefix workload ran with the cache and without; these engines report no prompt cache.
        prefix = part["prefix"]
        assert prefix["system_tokens"] == 16 and prefix["cached"]["errors"] == prefix["uncached"]["errors"] == [0]
        assert m["load_prefix_ttft_p50_ms"] > 0 and m["load_prefix_uncached_ttft_p50_ms"] > 0
        assert "load_prefix_cache_hit_rate" not in m and prefix["cached"]["cache_hit_rate"] == [None]
    assert result["bandwidth_gb_s"] > 0
    for name in result["plots"]:
        assert (path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (path / name).stat().st_size > 10_000
    # the candidate is int8: fewer weight bytes per step, so a higher predicted ceiling at batch 1
    ceiling = {role: result["per_role"][role]["roofline"][0]["tokens_per_s_per_user"] for role in result["per_role"]}
    assert ceiling["candidate"] > ceiling["baseline"]


def test_load_stage_logged_to_mlflow_with_artifacts(load_run):
    client = MlflowClient(tracking_uri=f"sqlite:///{load_run['work'] / 'mlflow.db'}")
    run = client.get_run(load_run["stage"]["mlflow_run"])
    assert run.data.tags["kiln.stage"] == "load" and run.data.metrics["candidate.load_tpot_p50_ms"] > 0
    # The whole stage folder, as laid out on disk: another machine reuses the stage from it.
    stage_files = {a.path for folder in ("stage", "stage/plots", "stage/records")
                   for a in client.list_artifacts(run.info.run_id, folder)}
    assert {"stage/result.json", "stage/manifest.json", "stage/plots/latency_vs_rate.png",
            "stage/plots/latency_throughput.png", "stage/plots/ceiling_vs_measured.png",
            "stage/records/baseline-r0.jsonl", "stage/records/candidate-r0.jsonl"} <= stage_files


def test_error_rate_check_reads_the_load_requests(load_run):
    verdict = json.loads((load_run["run_dir"] / "verdict.json").read_text())
    check = next(c for c in verdict["checks"] if c["kind"] == "error_rate")
    assert check["verdict"] != "Error" and check["observed"] == 0.0 and "requests" in check["reason"]


def test_report_embeds_plots_quality_deltas_and_lineage(load_run):
    run_dir = load_run["run_dir"]
    page = (run_dir / "report.html").read_text()
    images = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([^"]+)"', page)
    names = {alt for alt, _ in images}
    assert {"quality deltas", "TTFT and TPOT vs rate", "latency-throughput curve",
            "decode ceiling vs measured"} <= names
    assert all(base64.b64decode(data)[:4] == b"\x89PNG" for _, data in images)
    assert "<h2>Lineage</h2>" in page and "<h2>Memory and cost</h2>" in page and "MBU" in page
    assert "<h2>Knee (highest rate before TTFT climbs)</h2>" in page
    assert "<h2>Prefix cache (shared system prompt, distinct user turns)</h2>" in page
    assert "not reported by the engine" in page  # no hit rate made up for engines without a prompt cache
    md = (run_dir / "report.md").read_text()
    assert "plots/quality_deltas.png" in md and (run_dir / "plots" / "quality_deltas.png").is_file()
    lineage = json.loads((run_dir / "lineage.json").read_text())
    steps = [s["step"] for s in lineage]
    assert steps[0] == "recipe" and steps[-1] == "registry version" and "verdict" in steps
    assert {"optimize[candidate]", "engine[candidate]", "quality[candidate]", "load[pair]"} <= set(steps)
    stage = next(s for s in lineage if s["step"] == "load[pair]")
    assert stage["key"] == load_run["stage"]["key"] and stage["mlflow_run"] == load_run["stage"]["mlflow_run"]
    assert stage["mlflow_run"] in page and lineage[0]["key"] in md
    uri = f"sqlite:///{load_run['work'] / 'mlflow.db'}"
    registered = json.loads((run_dir / "registry.json").read_text())  # challenger only if the run passed
    mv = MlflowClient(tracking_uri=uri, registry_uri=uri).get_model_version("tinyload", str(registered["version"]))
    assert mv.tags["kiln.lineage.load.pair"].startswith(stage["key"]) and mv.tags["kiln.lineage.verdict"]
