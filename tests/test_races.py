"""16 writers x 50 measurements on one key, as separate processes with their own
connections: the best entry must end up as the true minimum and no measurement may be lost
(the upsert compares times inside the database, never in Python)."""

from __future__ import annotations

import multiprocessing
import random
from multiprocessing.synchronize import Barrier

from sqlalchemy import Engine

from tests.db_fixtures import lookup_params, measurement, measurement_count
from tuning_db import store
from tuning_db.engine import make_engine
from tuning_db.records import LookupQuery

WRITERS = 16
PER_WRITER = 50


def _write(db_url: str, writer: int, times_ms: list[float], start: Barrier) -> None:
    engine = make_engine(db_url)
    start.wait()
    for index, median_ms in enumerate(times_ms):
        store.record_measurement(engine, measurement(median_ms, host=f"writer{writer}-{index}"))
    engine.dispose()


def test_concurrent_writers_keep_the_true_minimum(db_url: str, engine: Engine) -> None:
    rng = random.Random(1234)
    times_ms = [value / 1000 for value in rng.sample(range(1_000, 1_000_000), WRITERS * PER_WRITER)]
    shares = [times_ms[writer::WRITERS] for writer in range(WRITERS)]
    fastest = min(times_ms)
    fastest_writer = next(writer for writer, share in enumerate(shares) if fastest in share)
    fastest_host = f"writer{fastest_writer}-{shares[fastest_writer].index(fastest)}"

    # fork: the children inherit the imported modules instead of importing torch again.
    context = multiprocessing.get_context("fork")
    start = context.Barrier(WRITERS)
    writers = [context.Process(target=_write, args=(db_url, n, shares[n], start)) for n in range(WRITERS)]
    for process in writers:
        process.start()
    for process in writers:
        process.join(timeout=120)
    assert [process.exitcode for process in writers] == [0] * WRITERS

    assert measurement_count(engine) == WRITERS * PER_WRITER
    best = store.lookup(engine, LookupQuery.model_validate(lookup_params())).entry
    assert best is not None
    assert (best.median_ms, best.host) == (fastest, fastest_host)
