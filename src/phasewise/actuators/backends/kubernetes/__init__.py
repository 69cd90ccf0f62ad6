"""The Kubernetes backend, in three modules: the API client (:mod:`.api`), the pure resize rules
(:mod:`.resize`) and the backend (:mod:`.backend`); imported only when ``backend=kubernetes``.
docs/kubernetes.md, "The Kubernetes backend".
"""

from phasewise.actuators.backends.kubernetes.api import ApiError, KubeApi, PodContainer, PodDirectory, path_resolver
from phasewise.actuators.backends.kubernetes.backend import RECREATE, KubernetesBackend, weight_advisory
from phasewise.actuators.backends.kubernetes.resize import (
    RecreatePolicy,
    ResizePlan,
    ResizeState,
    format_cpu,
    parse_quantity,
    plan_resize,
    recreatable,
    recreate_reason,
    resize_state,
)

__all__ = ["RECREATE", "ApiError", "KubeApi", "KubernetesBackend", "PodContainer", "PodDirectory", "RecreatePolicy",
           "ResizePlan", "ResizeState", "format_cpu", "parse_quantity", "path_resolver", "plan_resize", "recreatable",
           "recreate_reason", "resize_state", "weight_advisory"]
