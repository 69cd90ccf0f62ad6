"""``phasewise simulate``: replay a pod list against a node list through the placement policies."""
