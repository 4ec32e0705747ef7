"""Consistent hashing of requests onto the stable and canary arms, weighted by traffic share.

Why a ring: with prefix affinity, requests that share a prompt prefix land on the same arm, so
that arm's prefix (KV) cache stays warm. When the canary weight changes, only the keys whose arc
changes owner may move; everything else keeps its arm and its warm cache.

How weight maps onto the ring: each arm owns `vnodes` candidate points at fixed pseudo-random
positions (hash of "arm#i"). At canary weight w (percent), the canary activates its first
round(w/100 * vnodes) points and stable its first vnodes - that many. A key goes to the first
active point clockwise from its hash. Raising w only activates canary points and deactivates
stable points, so a key on a canary arc never moves back to stable, and a stable key moves only
when its arc is taken by a newly active canary point or its stable point is switched off: about
|delta w| of the keys move, the minimum any split can achieve. The canary's share of the ring is
the sum of its arcs, w/100 on average with a standard deviation of about sqrt(w(1-w)/vnodes)
(0.35 points at 5% with 4096 vnodes). Weight 0 and 100 are exact.

Within an arm, `ReplicaRing` does the same across the arm's replicas (several `kiln serve` of one
engine): a prompt prefix keeps its replica, and so that replica's prompt cache, as replicas come
and go.
"""

from __future__ import annotations

import bisect
import hashlib
import math

ARMS = ("stable", "canary")


def key_hash(key: bytes | str) -> int:
    """64-bit position on the ring (blake2b: fast, stable across processes, unlike hash())."""
    data = key.encode() if isinstance(key, str) else key
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class WeightedRing:
    def __init__(self, vnodes: int = 4096, weight: float = 0.0):
        self.vnodes = vnodes
        self._points = {arm: [key_hash(f"{arm}#{i}") for i in range(vnodes)] for arm in ARMS}
        self._positions: list[int] = []
        self._owners: list[str] = []
        self.weight = -1.0
        self.set_weight(weight)

    def set_weight(self, weight: float) -> None:
        """Canary share in percent (0-100)."""
        if not 0 <= weight <= 100:
            raise ValueError(f"weight must be between 0 and 100 (percent), got {weight}")
        n_canary = round(weight / 100 * self.vnodes)
        active = [(p, "canary") for p in self._points["canary"][:n_canary]]
        active += [(p, "stable") for p in self._points["stable"][: self.vnodes - n_canary]]
        active.sort()
        self._positions = [p for p, _ in active]
        self._owners = [a for _, a in active]
        self.weight = weight

    def arm_for(self, key: bytes | str) -> str:
        if self.weight <= 0:
            return "stable"
        if self.weight >= 100:
            return "canary"
        i = bisect.bisect_left(self._positions, key_hash(key))
        return self._owners[i % len(self._owners)]

    def canary_share(self) -> float:
        """Exact fraction of the ring (so of uniformly hashed keys) owned by the canary."""
        if not 0 < self.weight < 100:
            return self.weight / 100
        total, span = 2**64, 0
        prev = self._positions[-1] - total
        for pos, owner in zip(self._positions, self._owners, strict=True):
            if owner == "canary":
                span += pos - prev
            prev = pos
        return span / total


class ReplicaRing:
    """Consistent hashing of keys onto the replicas of one arm, so requests sharing a prompt prefix
    reach the replica whose prompt cache holds it.

    Each replica owns `vnodes` points at the hash of "<its URL>#i"; a key's replicas, in order, are
    the owners met clockwise from the key's hash, each once (`order`). Replicas are named by URL, so
    adding or removing one moves only the keys on its arcs (about 1/n of them), not the others.
    `pick` takes the first in that order whose requests in flight are within the bound of
    consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018): `bound` times
    the mean over replicas with this request counted. A hot prefix then spills to its next replica
    instead of queueing on one while the others idle.
    """

    def __init__(self, replicas: list[str], vnodes: int = 256):
        points = sorted((key_hash(f"{url}#{i}"), k) for k, url in enumerate(replicas) for i in range(vnodes))
        self.size = len(replicas)
        self._positions = [p for p, _ in points]
        self._owners = [k for _, k in points]

    def order(self, key: bytes | str) -> list[int]:
        """Replica indices in the order the ring offers them to `key`: its own first."""
        start, seen = bisect.bisect_left(self._positions, key_hash(key)), []
        for j in range(len(self._owners)):
            owner = self._owners[(start + j) % len(self._owners)]
            if owner not in seen:
                seen.append(owner)
                if len(seen) == self.size:
                    break
        return seen

    def pick(self, key: bytes | str, in_flight: list[int], bound: float) -> int:
        """The replica for `key`: the first in `order` whose load is within `bound` x the mean."""
        limit = math.ceil(bound * (sum(in_flight) + 1) / self.size)
        ranked = self.order(key)
        return next((k for k in ranked if in_flight[k] + 1 <= limit), ranked[0])
