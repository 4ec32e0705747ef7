"""The gate: one policy of checks, one file per check kind, registered in CHECKS."""

from kiln.core.gate import error_rate, lossless, performance, quality, size  # noqa: F401 - registration
from kiln.core.gate.base import CHECKS, CheckResult, Evidence, Verdict

__all__ = ["CHECKS", "CheckResult", "Evidence", "Verdict"]
