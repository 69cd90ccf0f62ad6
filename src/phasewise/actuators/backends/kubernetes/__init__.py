"""The Kubernetes backend, in four modules: the API client (:mod:`.api`), the pure resize rules
(:mod:`.resize`), the backend (:mod:`.backend`) and the job states of the node's pods
(:mod:`.pod_watch`); imported only when ``backend=kubernetes``.
docs/kubernetes.md, "The Kubernetes backend".
"""

from phasewise.actuators.backends.kubernetes.api import ApiError, KubeApi, PodContainer, PodDirectory, path_resolver
from phasewise.actuators.backends.kubernetes.backend import RECREATE, KubernetesBackend, weight_advisory
from phasewise.actuators.backends.kubernetes.pod_watch import JOB_KEY, PodJobState, PodWatch, pod_job_state
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

__all__ = ["JOB_KEY", "RECREATE", "ApiError", "KubeApi", "KubernetesBackend", "PodContainer", "PodDirectory",
           "PodJobState", "PodWatch", "RecreatePolicy", "ResizePlan", "ResizeState", "format_cpu", "parse_quantity",
           "path_resolver", "plan_resize", "pod_job_state", "recreatable", "recreate_reason", "resize_state",
           "weight_advisory"]
