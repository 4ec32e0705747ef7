"""Capacity plan: replicas needed for a target request rate, and what they cost per month; and
the one definition of cost per 1M tokens (`cost_per_million`) that the load summary, the decode
ceiling and the search report all print.

The input that matters is goodput per replica (requests/s one replica serves while meeting the
SLO, from a load test), not raw throughput: a replica run past its knee serves more requests
but misses the SLO on them. Headroom keeps every replica below that rate, for bursts and for a
replica lost to a rollout or a failure.

    replicas = ceil(target_rps / (goodput_per_replica * (1 - headroom)))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.core.errors import BadInput
from kiln.core.units import DEFAULT_CURRENCY, currency_problem, money, number

HOURS_PER_MONTH = 730.0  # 365 * 24 / 12


def cost_per_million(price_per_hour: float | None, tokens_per_s: float | None) -> float | None:
    """What 1M tokens cost on a machine priced `price_per_hour` that makes `tokens_per_s`; None
    when either is unknown (or zero)."""
    return price_per_hour / (tokens_per_s * 3600) * 1e6 if price_per_hour and tokens_per_s else None


@dataclass
class CapacityPlan:
    target_rps: float
    goodput_per_replica: float
    headroom: float
    price_per_hour: float | None
    replicas: int
    utilization: float  # target / (replicas * goodput): how busy each replica runs at the target
    currency: str = DEFAULT_CURRENCY  # what price_per_hour is in, and every cost is shown in

    @property
    def cost_per_hour(self) -> float | None:
        return self.replicas * self.price_per_hour if self.price_per_hour is not None else None

    @property
    def cost_per_month(self) -> float | None:
        return self.cost_per_hour * HOURS_PER_MONTH if self.cost_per_hour is not None else None

    def rows(self) -> list[tuple[str, str]]:
        rows = [
            ("target rate", f"{number(self.target_rps)} req/s"),
            ("goodput per replica (at SLO)", f"{number(self.goodput_per_replica)} req/s"),
            ("headroom", f"{self.headroom:.0%}"),
            ("replicas", str(self.replicas)),
            ("utilization at target", f"{self.utilization:.0%} of SLO goodput"),
        ]
        if self.cost_per_month is not None:
            rows += [
                ("price per replica-hour", money(self.price_per_hour, self.currency)),
                ("cost per month", f"{money(self.cost_per_month, self.currency)} ({HOURS_PER_MONTH:g} h)"),
            ]
        return rows

    def text(self) -> str:
        width = max(len(k) for k, _ in self.rows())
        return "\n".join(f"{k:<{width}}  {v}" for k, v in self.rows())

    def table(self):  # -> rich.table.Table
        """A rich Table for the CLI (`rich.print(plan.table())`)."""
        from rich.table import Table

        t = Table(title="Capacity plan", show_header=False)
        t.add_column(style="bold")
        t.add_column(justify="right")
        for k, v in self.rows():
            t.add_row(k, v)
        return t


def plan_capacity(
    target_rps: float, goodput_per_replica: float, headroom: float = 0.2, price_per_hour: float | None = None,
    currency: str = DEFAULT_CURRENCY,
) -> CapacityPlan:
    problems = []
    if not target_rps > 0:
        problems.append(f"target_rps must be > 0 (got {target_rps})")
    if not goodput_per_replica > 0:
        problems.append(
            f"goodput_per_replica must be > 0 (got {goodput_per_replica}): no request met the SLO; "
            "relax the SLO or fix the engine first"
        )
    if not 0 <= headroom < 1:
        problems.append(
            f"headroom must be in [0, 1) (got {headroom}), e.g. 0.2 keeps each replica at 80% of its goodput"
        )
    if price_per_hour is not None and price_per_hour < 0:
        problems.append(f"price_per_hour must be >= 0 (got {price_per_hour})")
    if why := currency_problem(currency):
        problems.append(f"currency: {why}")
    if problems:
        raise BadInput("capacity plan: bad input", problems)
    usable = goodput_per_replica * (1 - headroom)
    # Round before ceil so 10 / (5 * 0.8) = 2.5000000000000004 does not become 3 replicas by float noise.
    replicas = max(1, math.ceil(round(target_rps / usable, 9)))
    return CapacityPlan(
        target_rps,
        goodput_per_replica,
        headroom,
        price_per_hour,
        replicas,
        target_rps / (replicas * goodput_per_replica),
        currency,
    )
