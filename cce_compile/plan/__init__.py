"""The plan layer: which kernels a call launches (launch.py), how the backward is cut
(backward.py) and the thresholds both read (policy.py). Standard library only, so the plan of
any call can be read and tested without a GPU."""
