"""Placement: which node, and which GPUs on it, a job goes to; pure and deterministic.

The wing's modules: the cluster and its hard rules (:mod:`.cluster`), the policies horus, first-fit,
best-fit and fgd (:mod:`.policies`), FGD's fragmentation (:mod:`.fragmentation`), the waiting jobs'
index (:mod:`.waiting`) and the placement agent's per-record state (:mod:`.state`). Their public names
are importable from here. Narrative: docs/placement.md.
"""

from __future__ import annotations

from phasewise.models.jobs.placement.cluster import (
    MILLI,
    WORKLOADS,
    Cluster,
    Gpu,
    Job,
    Node,
    Placement,
    PlacementConfig,
)
from phasewise.models.jobs.placement.fragmentation import WorkloadTypes, fragmentation, workload_types
from phasewise.models.jobs.placement.policies import (
    POLICIES,
    BestFit,
    Fgd,
    FirstFit,
    Horus,
    PlacementPolicy,
    make_policy,
    place_many,
    why_not,
)
from phasewise.models.jobs.placement.waiting import WaitingJobs, need_of

__all__ = [
    "MILLI", "POLICIES", "WORKLOADS", "BestFit", "Cluster", "Fgd", "FirstFit", "Gpu", "Horus", "Job", "Node",
    "Placement", "PlacementConfig", "PlacementPolicy", "WaitingJobs", "WorkloadTypes", "fragmentation",
    "make_policy", "need_of", "place_many", "why_not", "workload_types",
]
