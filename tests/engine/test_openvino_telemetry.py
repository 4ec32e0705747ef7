"""kiln runs offline and writes nothing outside its cache: OpenVINO's and NNCF's usage telemetry (a client
id written to ~/intel on import, events sent to Google Analytics from child processes by the converter and
NNCF) is declined for kiln's process (kiln.engine.openvino.decline_telemetry). Checked in a child process
with its own HOME and no CI variable (the libraries decline by themselves under CI=true)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("openvino_telemetry", reason="installed with openvino, a kiln dependency")

BUILD = """
import sys
from pathlib import Path
import kiln.engine
from kiln.engine.cache import write_engine
from kiln.engine.openvino import OpenVINOConfig
write_engine(OpenVINOConfig(weights="int8", threads=1), Path(sys.argv[1]), "telemetry-test", Path(sys.argv[2]))
from openvino_telemetry.main import Telemetry
assert Telemetry._SingletonMetaClass__single_instance.consent is False
"""


def _run(code: str, home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "TF_BUILD", "JENKINS_URL")} | {"HOME": str(home)}
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=300)


def test_openvino_and_nncf_write_to_home_unless_kiln_declines(tiny_model_dir, tmp_path):
    bare, kiln_home = tmp_path / "bare", tmp_path / "kiln"
    bare.mkdir(), kiln_home.mkdir()
    # What the libraries do by themselves: importing them writes a client id under ~/intel.
    proc = _run("import openvino, nncf", bare)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (bare / "intel").is_dir(), "the libraries no longer write to ~/intel: is decline_telemetry still needed?"
    # kiln builds an int8 IR (the converter and NNCF, both of which send events) and writes nothing there.
    proc = _run(BUILD, kiln_home, str(tiny_model_dir), str(tmp_path / "engine"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "engine" / "openvino_model.xml").exists()
    assert not (kiln_home / "intel").exists(), sorted(p.name for p in (kiln_home / "intel").iterdir())
