"""The plan layer: which kernels a call launches (launch.py), how the backward is cut
(backward.py), the thresholds both read (policy.py) and the token bucket a traced N is keyed
for (tokens.py). Standard library only (tokens.py imports torch where it runs), so the plan
of any call can be read and tested without a GPU."""
