"""The in-process decode benchmark pairs each prompt's run on both arms, back to back, in
alternating order, and keeps one paired sample per pair."""

from __future__ import annotations

from kiln.engine.hf_torch import TorchEngine, TorchEngineConfig
from kiln.evaluate.decode_bench import interleaved


class Recording:
    """A real engine that notes, in a log shared by the arms, which arm each request went to."""

    def __init__(self, engine: TorchEngine, name: str, log: list[tuple[str, int]]):
        self.engine, self.name, self.log = engine, name, log

    def add(self, request):
        self.log.append((self.name, len(request.prompt_ids)))
        return self.engine.add(request)

    def __getattr__(self, attr):
        return getattr(self.engine, attr)


def test_pairs_alternate_and_every_pair_is_one_sample(tiny_model_dir):
    engine = TorchEngine(tiny_model_dir, TorchEngineConfig(threads=1))
    log: list[tuple[str, int]] = []
    arms = {"baseline": Recording(engine, "A", log), "candidate": Recording(engine, "B", log)}
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11, 12]]

    out = interleaved(arms, prompts, new_tokens=4, batch_sizes=[1], rounds=2)

    for samples in out.values():
        assert set(samples) == {"ttft_ms", "decode_tok_s", "tpot_ms"}
        assert all(len(v) == 6 and all(x > 0 for x in v) for v in samples.values())
    runs = log[2:]  # after one warm-up request per arm
    pairs = [runs[i:i + 2] for i in range(0, len(runs), 2)]
    assert [(a[0], b[0]) for a, b in pairs] == [("A", "B"), ("B", "A")] * 3
    assert all(a[1] == b[1] for a, b in pairs)  # both arms ran the same prompt
    assert [a[1] for a, _ in pairs] == [3, 4, 5] * 2


def test_batch_throughput_is_one_sample_per_round(tiny_model_dir):
    engine = TorchEngine(tiny_model_dir, TorchEngineConfig(threads=1))
    out = interleaved({"baseline": engine, "candidate": engine}, [[1, 2, 3], [4, 5]], new_tokens=3,
                      batch_sizes=[1, 4], rounds=3)
    for samples in out.values():
        assert len(samples["batch4_tok_s"]) == 3 and len(samples["decode_tok_s"]) == 6


def test_a_stop_rule_ends_the_measurement_after_the_round_it_says_so(tiny_model_dir):
    engine = TorchEngine(tiny_model_dir, TorchEngineConfig(threads=1))
    seen: list[int] = []

    def stop(samples):
        seen.append(len(samples["candidate"]["decode_tok_s"]))
        return len(seen) == 2

    out = interleaved({"baseline": engine, "candidate": engine}, [[1, 2, 3], [4, 5]], new_tokens=3,
                      batch_sizes=[1], rounds=4, stop=stop)
    assert seen == [2, 4]  # asked after rounds 1 and 2, with every pair so far; never after the last
    assert all(len(v) == 4 for arm in out.values() for v in arm.values())
    never = interleaved({"baseline": engine, "candidate": engine}, [[1, 2, 3]], new_tokens=3,
                        batch_sizes=[1], rounds=3, stop=lambda s: False)
    assert len(never["candidate"]["decode_tok_s"]) == 3


def test_a_model_compared_with_itself_is_never_failed_beside_a_busy_process(tiny_model_dir):
    """Both arms the same engine, one busy process spinning beside them: each half of every pair is
    watched, and neither a two-sided nor a min_ratio check Fails the model against itself."""
    import subprocess
    import sys

    from kiln.core.gate.base import Evidence, Verdict
    from kiln.core.gate.policy import judge
    from kiln.evaluate.contention import Watch, as_metrics
    from kiln.pipeline.recipe import GateSection

    engine = TorchEngine(tiny_model_dir, TorchEngineConfig(threads=1))
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with Watch() as watch:
            out = interleaved({"baseline": engine, "candidate": engine}, [[1, 2, 3], [4, 5, 6, 7], [8, 9]] * 4,
                              new_tokens=6, batch_sizes=[1], rounds=1, watch=watch)
            machine = as_metrics(watch.figures())
    finally:
        busy.kill()
        busy.wait()
    halves = [name for name in out["candidate"] if name.endswith("pressure")]
    assert halves == list(machine)[:1], "each arm's half of each pair carries the machine's pressure"
    assert all(len(arm[halves[0]]) == len(arm["decode_tok_s"]) == 12 for arm in out.values())
    speed = {"kind": "performance", "metric": "decode_tok_s"}
    policy = GateSection.model_validate({"checks": [{**speed, "min_ratio": 0.9}, {**speed, "max_ratio": 1.1}]})
    outcome = judge(policy, Evidence("candidate", metrics=machine, repeats=out["candidate"]),
                    Evidence("baseline", metrics=machine, repeats=out["baseline"]))
    for r in outcome.results:
        assert r.verdict in (Verdict.SUCCESSFUL, Verdict.INCONCLUSIVE), r.reason


class Drafting(Recording):
    """A real engine whose last event of each request carries drafting figures, as llama-server's
    timings give them: 6 tokens drafted per request, of which the prompt's length mod 4 accepted."""

    def step(self):
        from dataclasses import replace

        events = self.engine.step()
        return [replace(e, stats={"prompt_tokens": 3, "cached_tokens": 0, "draft_tokens": 6,
                                  "draft_accepted": self.log[-1][1] % 4}) if e.finish_reason else e for e in events]


def test_a_speculating_arm_records_its_drafts_per_request_and_its_acceptance_rate(tiny_model_dir):
    """The drafting figures the engine reports on a request's last event are samples beside its speed;
    the arm's acceptance rate is accepted / drafted over every request, not a median of per-request rates."""
    from kiln.evaluate.decode_bench import speculation

    engine = TorchEngine(tiny_model_dir, TorchEngineConfig(threads=1))
    log: list[tuple[str, int]] = []
    arms = {"baseline": Recording(engine, "A", log), "candidate": Drafting(engine, "B", log)}
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11, 12]]  # 3, 0 and 1 accepted

    out = interleaved(arms, prompts, new_tokens=4, batch_sizes=[1], rounds=2)

    assert set(out["baseline"]) == {"ttft_ms", "decode_tok_s", "tpot_ms"} and speculation(out["baseline"]) == {}
    assert out["candidate"]["draft_tokens"] == [6] * 6 and out["candidate"]["draft_accepted"] == [3, 0, 1] * 2
    assert speculation(out["candidate"]) == {"draft_tokens": 6, "draft_accepted": 4 / 3, "acceptance_rate": 4 / 18}
    assert speculation({"draft_tokens": [0, 0], "draft_accepted": [0, 0]}) == {"draft_tokens": 0, "draft_accepted": 0}
