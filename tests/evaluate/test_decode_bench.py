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

    def generate(self, requests):  # a batch: every request noted, then run together
        self.log.extend((self.name, len(r.prompt_ids)) for r in requests)
        return self.engine.generate(requests)

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
    from kiln.pipeline.recipe.schema import GateSection

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


def test_the_concurrency_sweep_pairs_groups_of_each_level(tiny_model_dir):
    """Each level cuts the prompts into groups of that many (the set repeated when shorter), one pair per
    group, both arms back to back in alternating order."""
    from kiln.evaluate.decode_bench import concurrency_sweep

    engine = TorchEngine(tiny_model_dir, TorchEngineConfig(threads=1))
    log: list[tuple[str, int]] = []
    arms = {"speculative": Recording(engine, "S", log), "plain": Recording(engine, "P", log)}
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]

    out = concurrency_sweep(arms, prompts, new_tokens=3, rounds=2, levels=(1, 2, 8))

    assert {k: len(v) for k, v in out["plain"].items()} == {"c1_tok_s": 8, "c2_tok_s": 4, "c8_tok_s": 2}
    assert all(x > 0 for arm in out.values() for v in arm.values() for x in v)
    sent = log[2:]  # after one warm-up request per arm
    assert len(sent) == 2 * 2 * (4 * 1 + 2 * 2 + 1 * 8)
    level1, level2, level8 = sent[:8], sent[8:16], sent[16:32]  # the first round
    assert [n for n, _ in level1] == ["S", "P", "P", "S"] * 2 and [k for _, k in level1[::2]] == [3, 4, 5, 2]
    assert [n for n, _ in level2] == ["S", "S", "P", "P", "P", "P", "S", "S"]  # 5 pairs so far: this one S first
    assert [k for _, k in level2[:4]] == [3, 4, 3, 4] and [k for _, k in level2[4:]] == [5, 2, 5, 2]
    assert [k for _, k in level8[:8]] == [3, 4, 5, 2] * 2  # the set repeated to fill the group


def test_speculation_stops_paying_where_its_interval_reaches_one():
    from kiln.core.metrics import SPEC_PAYS_UP_TO, SPEC_STOPS_PAYING
    from kiln.evaluate.decode_bench import stops_paying

    plain = {f"c{c}_tok_s": [100.0, 110.0, 90.0, 105.0] for c in (1, 2, 4, 8)}
    ratios = {1: [1.5, 1.4, 1.6, 1.45], 2: [1.2, 1.25, 1.3, 1.22], 4: [1.1, 0.95, 1.05, 0.9], 8: [0.8, 0.85, 0.9, 0.8]}
    fast = {f"c{c}_tok_s": [p * r for p, r in zip(plain[f"c{c}_tok_s"], ratios[c])] for c in ratios}
    figures = stops_paying(fast, plain, 0.95)
    assert figures[SPEC_STOPS_PAYING] == 4 and figures[SPEC_PAYS_UP_TO] == 2, figures
    assert figures["speculation_ratio_c1_lo"] > 1 and figures["speculation_ratio_c4_lo"] < 1 < figures["speculation_ratio_c4_hi"]
    assert abs(figures["speculation_ratio_c8"] - 0.836) < 0.01
    always = stops_paying({k: [2 * x for x in v] for k, v in plain.items()}, plain, 0.95)
    assert SPEC_STOPS_PAYING not in always and always[SPEC_PAYS_UP_TO] == 8
    never = stops_paying({k: [0.5 * x for x in v] for k, v in plain.items()}, plain, 0.95)
    assert never[SPEC_STOPS_PAYING] == 1 and never[SPEC_PAYS_UP_TO] == 0
