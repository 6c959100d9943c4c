"""Planner beyond this machine: a discrete-event simulator of colocated, chunked-prefill and
disaggregated serving under a calibrated cost model (``kvstore plan``; see docs/planner.md).

Library code in the "edges" layer: it imports numpy and nothing from ``benchmarks`` or torch.
"""

from kvstore.planner.costmodel import CostModel, TransferModel
from kvstore.planner.deployment import Arch, Deployment
from kvstore.planner.metrics import Metrics, RequestResult
from kvstore.planner.plan import PlanConfig, Planner
from kvstore.planner.simulator import SimResult, Simulator
from kvstore.workloads.slo import SLO
from kvstore.workloads.trace import Trace, TraceRequest

__all__ = ["Arch", "CostModel", "Deployment", "Metrics", "PlanConfig", "Planner", "RequestResult", "SLO",
           "SimResult", "Simulator", "Trace", "TraceRequest", "TransferModel"]
