"""A real Ray cluster on this host for the tests: a head and worker nodes, each its own raylet with
one CPU, the one `kiln_timed` unit every node of a kiln cluster declares, its own kiln cache (nodes
share nothing but the tracking server) and the tracking server's client environment, no dashboard.
Ray's own multi-node-on-one-host setup (`ray.cluster_utils.Cluster`); shut down on the way out, so
no raylet or GCS process outlives the test.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.pipeline.conftest import fresh_cache

NODE = {"num_cpus": 1, "resources": {"kiln_timed": 1}, "include_dashboard": False}


@dataclass
class LocalCluster:
    cluster: Any
    address: str
    caches: dict[str, Path] = field(default_factory=dict)  # node id -> that node's KILN_CACHE
    nodes: dict[str, Any] = field(default_factory=dict)  # node id -> ray's Node (what remove_node kills)

    def add(self, cache: Path, env: dict[str, str]) -> str:
        with _environment({**env, "KILN_CACHE": str(fresh_cache(cache))}):  # what the node's processes inherit
            node = self.cluster.add_node(**NODE)
        self.caches[node.node_id], self.nodes[node.node_id] = cache, node
        return node.node_id

    def kill(self, node_id: str) -> None:
        """The node's raylet and every worker on it, killed (SIGKILL): a machine that went away."""
        self.cluster.remove_node(self.nodes.pop(node_id), allow_graceful=False)


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def ray_cluster(work: Path, nodes: int, env: dict[str, str]) -> Iterator[LocalCluster]:
    """`nodes` nodes (the first is the head), node i's cache at work/node-i."""
    from ray.cluster_utils import Cluster

    env = {**env, "RAY_USAGE_STATS_ENABLED": "0"}
    with _environment(env):
        cluster = Cluster(initialize_head=False, connect=False)
    local = LocalCluster(cluster, "")
    try:
        for i in range(nodes):
            local.add(work / f"node-{i}", env)
        local.address = cluster.address
        cluster.wait_for_nodes()
        yield local
    finally:
        cluster.shutdown()
