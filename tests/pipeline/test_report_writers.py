"""A run's outputs are registered writers that `report.publish` composes (issue 55, point 2): Markdown, HTML, JSON,
MLflow and the registry, and any writer registered beside them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from kiln.core.errors import BadInput
from kiln.pipeline.report import report
from tests.pipeline.conftest import quick_recipe

# `kiln run` with one more writer registered before it starts, as a plugin would; the real CLI otherwise.
TOY_RUN = """
import json
from kiln.pipeline.report import report

@report.writer("toy")
def toy(r):
    seen = {"recipe": r.ctx.recipe.name, "verdict": r.outcome.verdict.value, "version": r.version["version"],
            "checks": [c.name for c in r.outcome.results], "written_before": list(r.files)}
    (r.ctx.run_dir / "toy.json").write_text(json.dumps(seen))
    return ["toy.json"]

from kiln.pipeline.cli.main import main
main()
"""


def test_the_writers_run_in_order_mlflow_and_the_registry_last():
    assert list(report.WRITERS)[:5] == ["json", "markdown", "html", "mlflow", "registry"]
    assert report.resolve() == [report.write_json, report.write_markdown, report.write_html, report.write_mlflow,
                                report.write_registry]
    assert report.resolve(["html"]) == [report.write_html]
    with pytest.raises(BadInput, match="Unknown report output 'markdwon'. Did you mean 'markdown'"):
        report.resolve(["markdwon"])
    with pytest.raises(RuntimeError, match="registered twice"):
        report.writer("json")(report.write_json)


def test_a_registered_writer_gets_the_report_writes_its_file_and_mlflow_keeps_it(tmp_path, tiny_model_dir):
    recipe = quick_recipe(tmp_path / "toy.yaml", tiny_model_dir, "toy-writer")
    proc = subprocess.run([sys.executable, "-c", TOY_RUN, "run", str(recipe)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "KILN_HOME": str(tmp_path)})
    assert proc.returncode in (0, 1, 3), proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = next((tmp_path / "runs").iterdir())
    seen = json.loads((run_dir / "toy.json").read_text())
    verdict = json.loads((run_dir / "verdict.json").read_text())
    registered = json.loads((run_dir / "registry.json").read_text())
    assert seen == {"recipe": "toy-writer", "verdict": verdict["verdict"], "version": registered["version"],
                    "checks": [c["name"] for c in verdict["checks"]],
                    "written_before": ["comparisons.json", "registry.json", "lineage.json", "report.md", "report.html"]}
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    version = client.get_model_version("toy-writer", str(registered["version"]))
    artifacts = {a.path for a in client.list_artifacts(version.run_id)}
    assert {"toy.json", "report.md", "report.html", "verdict.json", "comparisons.json", "registry.json",
            "lineage.json"} <= artifacts  # the mlflow writer ran after it and logged its file with the others
    assert version.tags["kiln.registration"] == "complete" and version.tags["kiln.verdict"] == verdict["verdict"]
