"""The token bucket a call's config is keyed for, where torch.compile may trace N as a SymInt.

Torch-free to import, as the rest of plan/: torch is imported where traced_n_bucket runs, which
is from the ops (torch loaded) or for a SymInt (torch loaded).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config.keys import n_bucket

if TYPE_CHECKING:
    import torch

DATA_DEPENDENT_N_BUCKET = 8192
"""The token bucket of a data-dependent N (the tokens a boolean mask selects) without a finite
upper bound: no value to bucket while tracing, so one graph serves every N, with the bucket the
bundled configs were tuned at."""

_LARGEST_BUCKET = 1 << 63
"""The bucket of the largest size (sys.maxsize: a declared max of it stands for none where
mark_dynamic refuses a min alone); past it a range is unbounded (ShapeEnv's int_oo)."""


def traced_n_bucket(n: int | torch.SymInt) -> int:
    """config.keys.n_bucket of N, an int or N as torch.compile traces it, where each choice
    between buckets is a guard. Tuned configs differ per power of two, so where a guard is
    allowed (dynamic=True, automatic dynamic shapes, a plain mark_dynamic the guard only
    narrows) a traced N guards on the traced value's bucket (B/2, B]: one graph per bucket,
    with its config. torch._dynamo.mark_dynamic refuses a guard that narrows a declared range
    or pins the dimension to one value (ConstraintViolationError), and a data-dependent N has
    no value to guard on; there the bucket is chosen otherwise:

    - N's range has a finite upper bound (a declared max, a mask's size, the graph's other
      guards) or already lies in one bucket (this trace's guard): the bucket of that bound, no
      guard; the config of the largest N the graph serves;
    - the traced N is the smallest N can be (a dynamic dimension at its minimum, a batch of 2)
      and its bucket may hold no other N, so that the bucket's guard would pin the dimension
      (N = 2T is alone in (T, 2T]): one guard N <= twice the bucket, which leaves it more than
      one value (a batch of 2 to 4), and that bucket's config; a larger N compiles its own
      graph, per bucket as above (the check's both sides are statically_known_true, which adds
      no guard);
    - else the guard; DATA_DEPENDENT_N_BUCKET where it cannot be decided (N without a value:
      guard_or_false answers False there instead of raising).

    A bucket's config is correct for any N (it picks tiles, and every kernel takes N as it
    runs), and the backward's plan, which sizes its memory, is made as the op runs, for N
    itself (the custom ops are opaque to torch.compile and run per call:
    plan.backward.planning_tokens), so a graph serving N outside its config's bucket only
    runs tiles tuned for another N.

    Runs inside Dynamo's trace (ops/problem.traced_settings), so it reads N only through the
    symbolic-shape helpers Dynamo evaluates on the real SymInt (statically_known_true,
    guard_or_false, the hint) and Python arithmetic: Dynamo cannot trace into N's sympy
    expression or its ShapeEnv."""
    import torch

    if isinstance(n, int) and not torch.compiler.is_compiling():
        return n_bucket(n)  # eager calls (Dynamo answers isinstance(n, int) for a SymInt too)
    from torch.fx.experimental.symbolic_shapes import guard_or_false, statically_known_true

    bound = 1
    while bound <= _LARGEST_BUCKET:
        if statically_known_true(n <= bound):
            return bound
        bound *= 2
    hint = _traced_value(n)
    bucket = n_bucket(hint)
    if statically_known_true(n >= hint) and _alone_in_bucket(n, hint, bucket) and guard_or_false(n <= 2 * bucket):
        return 2 * bucket
    if guard_or_false(n > bucket // 2) and guard_or_false(n <= bucket):
        return bucket
    return DATA_DEPENDENT_N_BUCKET


def _alone_in_bucket(n, least: int, bucket: int) -> bool:
    """Whether N, at its least value `least`, may take no other value up to `bucket`, so that
    guarding N <= bucket could pin its dimension. Provably not where N steps by least / 2 from
    there (N = c x s, s >= 2: N - least a multiple of least / 2, not provably of least) and
    least + least / 2 fits the bucket; where N takes another form (N = c x (s - 1), whose next
    value 2 x least passes the bucket; a product of two dimensions) it is not known, and taken
    as alone: a wider bucket costs its config's fit, a pinning guard fails the compile."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    step = least // 2
    if least == bucket or least % 2 or least + step > bucket:
        return True
    return not statically_known_true((n - least) % step == 0) or statically_known_true((n - least) % least == 0)


def _traced_value(n) -> int:
    """N's value where this trace began (its hint), read without a guard: optimization_hint
    (torch 2.13), size_hint before it (2.11), both of which Dynamo evaluates on the SymInt. At
    least 2, as a size with a value is (a data-dependent N has none: the fallback or a guess
    stands in, and guard_or_false then decides nothing)."""
    from torch.fx.experimental import symbolic_shapes

    read = getattr(symbolic_shapes, "optimization_hint", None) or symbolic_shapes.size_hint
    return max(2, int(read(n, DATA_DEPENDENT_N_BUCKET)))
