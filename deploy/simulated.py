"""A simulated deploy target: arms drawn from known distributions on a virtual clock.

For what real processes cannot do cheaply: run thousands of canary walks to measure how often the
controller rolls back a healthy canary (false rollbacks) or promotes a regressed one, and how many
requests a decision takes (bench/canary_sim.py), and test the controller's step logic in
milliseconds. Latencies are lognormal (median, log-sd), failures Bernoulli; each look brings
`rate * poll_s` requests split by the current weight. Pass `target.sleep` and `target.clock` to the
Controller so time is virtual.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.deploy.base import ArmData, DeployTarget, Observations
from kiln.deploy.observations import Comparison


@dataclass
class ArmModel:
    ttft_ms: float = 50.0
    tpot_ms: float = 20.0
    sigma: float = 0.3  # log-sd of both latencies
    error_rate: float = 0.0
    # Mean served_prefix of a mirrored greedy answer against stable's first answer; for the stable
    # arm: its second answer's, the noise floor (1.0: deterministic).
    served_prefix: float = 1.0

    def draw(self, n: int, rng: np.random.Generator) -> ArmData:
        errors = (rng.random(n) < self.error_rate).astype(int)
        ok = int(n - errors.sum())
        return ArmData(ttft_ms=list(self.ttft_ms * np.exp(rng.normal(0, self.sigma, ok))),
                       tpot_ms=list(self.tpot_ms * np.exp(rng.normal(0, self.sigma, ok))),
                       errors=list(errors))

    def agree(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """served_prefix of n mirrored answers: identical (1.0) with probability 2m - 1, else a
        prefix uniform in [0, 1) (or in [0, 2m) when the mean m is under 0.5)."""
        m = self.served_prefix
        exact = rng.random(n) < max(2 * m - 1, 0.0)
        return np.where(exact, 1.0, rng.random(n) * min(1.0, 2 * m))


class SimulatedTarget(DeployTarget):
    name = "simulated"

    def __init__(self, stable: ArmModel, canary: ArmModel, rate: float = 50.0, mirror_fraction: float = 0.0,
                 seed: int = 0):
        self.models = {"stable": stable, "canary": canary}
        self.rate, self.mirror_fraction = rate, mirror_fraction
        self.rng = np.random.default_rng(seed)
        self.weight = 0.0
        self.now = 0.0
        self._pending = 0.0  # seconds of traffic not yet observed
        self.history: list[tuple[str, float]] = []  # ("weight", w) | ("promote", w) | ("rollback", w)
        self.seq = 0
        self.mirrored = 0  # mirrored prompts so far (each costs 2 extra requests)

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self._pending += seconds

    def clock(self) -> float:
        return self.now

    def set_traffic(self, weight: float) -> None:
        self.weight = weight
        self.history.append(("weight", weight))

    def observe(self, cursor: tuple[int, int] = (0, 0)) -> Observations:
        n = int(self.rng.poisson(self.rate * self._pending))
        self._pending = 0.0
        n_canary = int(self.rng.binomial(n, self.weight / 100))
        obs = Observations(self.models["stable"].draw(n - n_canary, self.rng),
                           self.models["canary"].draw(n_canary, self.rng))
        mirrored = int(self.rng.binomial(n, self.mirror_fraction)) if 0 < self.weight < 100 else 0
        self.mirrored += mirrored
        prefix = self.models["canary"].agree(mirrored, self.rng)
        floor = self.models["stable"].agree(mirrored, self.rng)
        obs.mirrored = [Comparison(0, self.now, "stable", float(p), float(p == 1), float(f), float(f == 1))
                        for p, f in zip(prefix, floor, strict=True)]
        self.seq += n
        obs.cursor = (self.seq, 0)
        return obs

    def promote(self) -> None:
        self.history.append(("promote", self.weight))

    def rollback(self) -> None:
        self.history.append(("rollback", self.weight))
