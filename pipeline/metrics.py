"""Every metric kiln reports, declared once with its direction and unit.

A gate needs to know whether up is good (lm-eval's `higher_is_better` idea): checks read the
direction from here, never from the recipe, so a policy cannot get it backwards.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.pipeline.errors import BadInput


@dataclass(frozen=True)
class Metric:
    name: str
    higher_is_better: bool
    unit: str
    description: str
    kind: str  # "quality" (per-sample, paired) | "performance" (repeats) | "size" | "error_rate"


METRICS: dict[str, Metric] = {}


def declare(name: str, higher_is_better: bool, unit: str, description: str, kind: str) -> Metric:
    m = Metric(name, higher_is_better, unit, description, kind)
    METRICS[name] = m
    return m


def metric(name: str, where: str) -> Metric:
    if name not in METRICS:
        from kiln.pipeline.registry import did_you_mean

        raise BadInput(f"{where}: unknown metric '{name}'.{did_you_mean(name, list(METRICS))}")
    return METRICS[name]


# Quality: per-sample values joined on doc id between baseline and candidate.
declare("perplexity", False, "", "token perplexity on held-out text (per-document NLL, paired)", "quality")
declare("top1_agreement", True, "fraction", "positions where candidate's argmax equals baseline's", "quality")
declare("kl_mean", False, "nats", "mean KL(baseline || candidate) of next-token distributions", "quality")
declare("kl_p99", False, "nats", "99th percentile of per-position KL divergence", "quality")
declare("greedy_match", True, "fraction", "greedy continuations identical to the baseline's", "quality")
# Performance: measured in interleaved repeats, compared as ratios with intervals.
declare("decode_tok_s", True, "tok/s", "decode tokens per second per sequence at batch 1", "performance")
declare("ttft_ms", False, "ms", "time to first token (prefill) of the benchmark prompts", "performance")
declare("tpot_ms", False, "ms", "time per output token after the first", "performance")
# Footprint.
declare("size_bytes", False, "bytes", "checkpoint size on disk", "size")
declare("error_rate", False, "fraction", "failed requests / all requests", "error_rate")
