"""Transitional: the stage kinds that lived here moved to modules named for them (issue 36):
stage_optimize (quantize, engine, tune, the parity smoke check), stage_evaluate (perplexity,
agreement, served text, lm-eval), stage_benchmark (decode benchmark, load, confirmation, futility),
stage_inputs (texts, prompts, token ids, engines loaded on first use, the input checks) and
stage_gate (the verdict). Only callers outside the pipeline helper's rooms still import from here:
pipeline/search.py, tests/evaluate/test_tune.py, tests/engine/test_ctranslate2.py and
bench/quantize_methods.py. Delete this file once they import from the modules above."""

from kiln.pipeline.stage_benchmark import benchmark, load_stage  # noqa: F401
from kiln.pipeline.stage_evaluate import evaluate  # noqa: F401
from kiln.pipeline.stage_inputs import LazyEngines, check_backends  # noqa: F401
from kiln.pipeline.stage_optimize import calibration_text, engine, optimize_both, quantize  # noqa: F401
