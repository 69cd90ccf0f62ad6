"""Cgroups: where containers are (layouts, the file system) and who they are (workloads); docs/kubernetes.md."""
