"""`cce tune`'s machinery: candidate configs (candidates), the coordinate-descent search
with its correctness gate and timers (tuner), and where results go (publish)."""
