"""Every metric kiln reports, declared once with its direction and unit.

A gate needs to know whether up is good (lm-eval's `higher_is_better` idea): checks read the
direction from here, never from the recipe, so a policy cannot get it backwards. It also needs to
know what measures a metric: `measured_by` names the recipe section whose stage records it (and
`task`, the lm-eval task that must be listed), so `kiln validate` refuses a gate check no stage of
the recipe would measure instead of letting it end Inconclusive (kiln.pipeline.recipe.schema).
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.core.errors import BadInput


@dataclass(frozen=True)
class Metric:
    name: str
    higher_is_better: bool
    unit: str
    description: str
    kind: str  # "quality" (per-sample, paired) | "performance" (repeats) | "size" | "error_rate" | "machine" | "engine"
    # The recipe section whose stage records it, as a dotted path ("evaluate.load"); measured when
    # that section is set (not null, not false). None: no stage records it for the gate to judge.
    measured_by: str | None = None
    task: str | None = None  # an lm-eval task's metric: evaluate.quality.lmeval.tasks must list the task


METRICS: dict[str, Metric] = {}
LMEVAL = "evaluate.quality.lmeval"  # the section of every lm-eval task's metrics


def declare(name: str, higher_is_better: bool, unit: str, description: str, kind: str,
            measured_by: str | None = None, task: str | None = None) -> Metric:
    m = Metric(name, higher_is_better, unit, description, kind, measured_by, task)
    METRICS[name] = m
    return m


def metric(name: str, where: str) -> Metric:
    if name not in METRICS:
        from kiln.core.registry import did_you_mean

        raise BadInput(f"{where}: unknown metric '{name}'.{did_you_mean(name, list(METRICS))}")
    return METRICS[name]


# Quality: per-sample values joined on doc id between baseline and candidate.
declare("perplexity", False, "", "token perplexity on held-out text (per-document NLL, paired)", "quality",
        "evaluate.quality.perplexity")
AGREEMENT = "evaluate.quality.agreement"
declare("top1_agreement", True, "fraction", "positions where candidate's argmax equals baseline's", "quality",
        AGREEMENT)
declare("kl_mean", False, "nats", "mean KL(baseline || candidate) of next-token distributions", "quality", AGREEMENT)
declare("kl_p99", False, "nats", "99th percentile of per-position KL divergence", "quality", AGREEMENT)
declare("greedy_match", True, "fraction", "greedy continuations identical to the baseline's", "quality", AGREEMENT)
# Performance: measured in interleaved repeats, compared as ratios with intervals.
BENCHMARK = "evaluate.benchmark"
declare("decode_tok_s", True, "tok/s", "decode tokens per second per sequence at batch 1", "performance", BENCHMARK)
declare("ttft_ms", False, "ms", "time to first token (prefill) of the benchmark prompts", "performance", BENCHMARK)
declare("tpot_ms", False, "ms", "time per output token after the first", "performance", BENCHMARK)
# How busy the machine was during the decode benchmark (kiln.evaluate.contention): not gated on
# its own; a speed check measured above its bound is Inconclusive. The pressure's name says which
# signal measured it (PSI, or the run queue where PSI is missing).
BENCH_PRESSURE = "bench_cpu_pressure"
BENCH_RUN_QUEUE = "bench_run_queue_pressure"
BENCH_STEAL = "bench_cpu_steal"
PRESSURE_BY_SIGNAL = {"PSI": BENCH_PRESSURE, "run queue": BENCH_RUN_QUEUE}
# Evidence.counts of the load stage: (headline stages the client could not send on time, repeats).
CLIENT_LIMITED = "load_client_limited"
declare(BENCH_PRESSURE, False, "fraction", "share of the decode benchmark's wall time a task waited for a CPU "
        "(Linux PSI): other jobs competing with the measurement", "machine")
declare(BENCH_RUN_QUEUE, False, "fraction", "runnable tasks beyond the CPUs the decode benchmark may use, per CPU, "
        "averaged over run-queue samples (where PSI is missing; reads as PSI does): other jobs competing", "machine")
declare(BENCH_STEAL, False, "fraction", "share of CPU time the hypervisor gave other guests during the decode "
        "benchmark (steal, /proc/stat)", "machine")
# What a speculating engine reports of its drafts in the decode benchmark (TokenEvent.stats; per request,
# kiln.evaluate.decode_bench.speculation): shown beside the speed it explains, not gated on its own.
declare("draft_tokens", False, "tokens", "tokens the engine drafted per benchmark request (speculative decoding)",
        "engine")
declare("draft_accepted", True, "tokens", "drafted tokens the model accepted per benchmark request", "engine")
declare("acceptance_rate", True, "fraction", "drafted tokens accepted / drafted over the benchmark's requests", "engine")
# A speculating candidate against its plain twin at rising concurrency (kiln.evaluate.decode_bench.stops_paying).
SPEC_STOPS_PAYING, SPEC_PAYS_UP_TO = "speculation_stops_paying_at", "speculation_pays_up_to"
declare(SPEC_STOPS_PAYING, True, "requests", "the first concurrency at which speculation's speed-up over its plain "
        "twin is no longer surely above 1 (its interval reaches 1)", "engine")
declare(SPEC_PAYS_UP_TO, True, "requests", "the highest concurrency up to which speculation surely beats its plain "
        "twin at every level (0: not even at 1)", "engine")


def sweep_ratio(level: int) -> str:
    """The speculating candidate's aggregate tok/s over its plain twin's at concurrency `level` (+ _lo, _hi)."""
    return f"speculation_ratio_c{level}"
# Footprint.
# Every arm is built (optimize: a search sets it per candidate), so the build always measures its size.
declare("size_bytes", False, "bytes", "checkpoint size on disk", "size", "optimize")
LOAD = "evaluate.load"
declare("error_rate", False, "fraction", "failed requests / all requests", "error_rate", LOAD)
# Under load: the evaluate.load stage serves each arm over HTTP and reads these from its headline
# stage (the knee of a sweep, else the only or last stage); one value per interleaved repeat.
LOAD_PREFIX = "load_"
for _name, _up, _unit, _what in (
    ("ttft_p50_ms", False, "ms", "time to first token, median"),
    ("ttft_p95_ms", False, "ms", "time to first token, 95th percentile"),
    ("tpot_p50_ms", False, "ms", "time per output token, median"),
    ("tpot_p95_ms", False, "ms", "time per output token, 95th percentile"),
    ("itl_p50_ms", False, "ms", "inter-token latency, median"),
    ("itl_p95_ms", False, "ms", "inter-token latency, 95th percentile"),
    ("e2e_p50_ms", False, "ms", "request latency end to end, median"),
    ("e2e_p95_ms", False, "ms", "request latency end to end, 95th percentile"),
    ("output_token_throughput", True, "tok/s", "output tokens per second, all users together"),
    ("request_throughput", True, "req/s", "completed requests per second"),
    ("goodput", True, "req/s", "requests per second that met the TTFT and TPOT SLOs"),
    ("slo_attainment", True, "fraction", "completed requests that met both SLOs"),
    ("cost_per_1m_output_tokens", False, "currency", "machine price / output tokens, per million"),  # the recipe's
    ("knee_rate", True, "req/s", "highest request rate before TTFT climbs (the sweep's knee)"),
):
    declare(LOAD_PREFIX + _name, _up, _unit, f"{_what} (served over HTTP under the load shape)", "performance",
            f"{LOAD}.price_per_hour" if _name.startswith("cost_") else LOAD)
declare("peak_rss_bytes", False, "bytes", "peak resident memory while producing the artifact", "size")
# What each stage held (kiln.pipeline.stages.rss): kiln's own process, and the processes it started.
for _stage in ("optimize", "engine", "quality", "agreement", "served", "lmeval", "benchmark", "load"):
    declare(f"{_stage}_peak_rss_bytes", False, "bytes", f"peak resident memory of kiln's process in the {_stage} stage",
            "machine")
    declare(f"{_stage}_children_peak_pss_bytes", False, "bytes",
            f"peak summed PSS of the processes the {_stage} stage started", "machine")

# The deciding figures a pipeline's parent MLflow run carries, so its runs table shows and sorts them
# (kiln.pipeline.report.report.run_figures): the gate's figures of the candidate the run judged (a search's winner).
SPEEDUP = "speedup"  # decode tok/s, candidate / baseline: the paired ratio of a decode speed check
COST_PER_1M = "cost_per_1m"  # .candidate, .baseline: per 1M output tokens under the load shape, recipe's currency
COST_PER_1M_B1 = "cost_per_1m_b1"  # .candidate, .baseline: per 1M output tokens at batch 1 (search.price_per_hour)


def ratio_figure(metric_name: str) -> str:
    """A ratio check's candidate / baseline: `speedup` for decode tok/s, else `ratio.<metric>`."""
    return SPEEDUP if metric_name == "decode_tok_s" else f"ratio.{metric_name}"


def delta_figure(metric_name: str) -> str:
    """A paired quality metric's candidate - baseline (perplexity: relative, a fraction of the baseline)."""
    return f"quality.{metric_name}.delta"


def interval_figures(name: str) -> tuple[str, str]:
    """The names of a figure's interval ends: `speedup_lo`, `speedup_hi`."""
    return f"{name}_lo", f"{name}_hi"
