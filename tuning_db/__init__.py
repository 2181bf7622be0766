"""Shared store of the best kernel launch configs per GPU and problem shape.

Every node of a cluster asks this store (directly or through the service) for the best
config known for its GPU and shape instead of re-autotuning. Layers: `records` (validated
input and output data), `models` (tables), `engine` (connections), `migrate` (schema
versions), `store` (the operations the service and the CLI call).
"""
