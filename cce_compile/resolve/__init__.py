"""Which KernelConfig a call launches with: the ladder (ladder.py) over its sources (an
override, the memo, disk cache and bundled configs in sources.py, the service in client.py,
heuristic.py), for the platform of platform.py."""
