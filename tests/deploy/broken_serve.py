"""`kiln serve` on the engine that corrupts batched tokens (tests/evaluate/broken_engine.py): the
real CLI and server, with the torch backend building a BatchBrokenEngine where it builds a
TorchEngine. For test_prometheus.py's canary that serves fast, error-free, wrong text:

    python -m tests.deploy.broken_serve serve ENGINE_DIR --port N   # `kiln serve`'s arguments
"""

from __future__ import annotations

from kiln.engine import hf_torch
from kiln.pipeline.cli.main import main
from tests.evaluate.broken_engine import BatchBrokenEngine

if __name__ == "__main__":
    hf_torch.TorchEngine = BatchBrokenEngine  # TorchBackend.load looks the class up at call time
    main()
