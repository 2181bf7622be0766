"""The tuning database's store, on SQLite and PostgreSQL: schema, best-keeping, lookup
levels, listing, export/import and retirement."""

from __future__ import annotations

import io
import json
import multiprocessing
import re
import sqlite3
import threading
import time
import uuid
from multiprocessing.synchronize import Barrier
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, event, select, text, update
from sqlalchemy.exc import OperationalError

from tests.db_fixtures import (
    GPU_H100,
    H100_KEY,
    POSTGRES_URL,
    lookup_params,
    measurement,
    measurement_count,
    measurement_data,
)
from tuning_db import engine as engine_module
from tuning_db import store
from tuning_db.engine import DB_URL_ENV, make_engine, resolve_db_url, sqlite_file
from tuning_db.migrate import current_revision, head_revision, upgrade
from tuning_db.models import Base, Measurement
from tuning_db.records import ConfigFilters, LookupQuery, normalize_gpu_name
from tuning_db.scratch import scratch_schema


def lookup(engine: Engine, **overrides: Any) -> store.LookupResult:
    return store.lookup(engine, LookupQuery.model_validate(lookup_params(**overrides)))


def test_migrations_create_exactly_the_models(engine: Engine) -> None:
    with engine.connect() as connection:
        assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
    assert current_revision(engine) == head_revision()


def test_upgrade_twice_is_harmless(db_url: str, engine: Engine) -> None:
    store.record_measurement(engine, measurement())
    assert upgrade(db_url) == head_revision()
    assert measurement_count(engine) == 1


def _upgrade_at(url: str, start: Barrier) -> None:
    start.wait()
    upgrade(url)


def test_concurrent_upgrades_of_an_empty_postgres_schema_all_succeed(postgres_url: str) -> None:
    """Several `cce db upgrade` at once on an empty schema: all but one once failed with a
    duplicate key in pg_type (each created alembic_version), the DDL not serializing them."""
    context = multiprocessing.get_context("fork")  # the children inherit the imported modules
    for _trial in range(3):
        with scratch_schema(POSTGRES_URL, prefix="cce_test_upgrade") as url:
            start = context.Barrier(4)
            upgrades = [context.Process(target=_upgrade_at, args=(url, start)) for _ in range(4)]
            for process in upgrades:
                process.start()
            for process in upgrades:
                process.join(timeout=60)
            assert [process.exitcode for process in upgrades] == [0] * 4
            engine = make_engine(url)
            assert current_revision(engine) == head_revision()
            engine.dispose()


def test_sqlite_runs_in_wal_mode_with_a_busy_timeout(sqlite_url: str) -> None:
    engine = make_engine(sqlite_url)
    with engine.connect() as connection:
        assert connection.scalar(text("PRAGMA journal_mode")) == "wal"
        assert connection.scalar(text("PRAGMA busy_timeout")) == 30_000
    engine.dispose()


def test_default_database_is_an_sqlite_file_in_the_user_cache(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(DB_URL_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert resolve_db_url() == f"sqlite:///{tmp_path / 'cce_compile' / 'tuning.db'}"
    monkeypatch.setenv(DB_URL_ENV, "sqlite:///elsewhere.db")
    assert resolve_db_url() == "sqlite:///elsewhere.db"
    assert resolve_db_url("sqlite:///given.db") == "sqlite:///given.db"


def test_a_relative_sqlite_file_removed_after_a_chdir_is_not_written_on(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLAlchemy opens a relative path made absolute when the engine was made, while the check
    that the file is still there looked at the relative path: after a chdir it found no file
    at connect and none at checkout, so a pooled connection went on in a removed file."""
    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path)
    engine = make_engine("sqlite:///tuning.db")
    with engine.begin() as connection:
        connection.execute(text("CREATE TABLE kept (x INTEGER)"))
    monkeypatch.chdir(tmp_path / "run")
    with engine.connect() as connection:
        connection.scalar(text("SELECT count(*) FROM kept"))
    for suffix in ("", "-wal", "-shm"):
        (tmp_path / f"tuning.db{suffix}").unlink(missing_ok=True)
    with engine.connect() as connection, pytest.raises(OperationalError, match="no such table"):
        connection.scalar(text("SELECT count(*) FROM kept"))
    engine.dispose()


@pytest.mark.parametrize("folder", ["cache?x", "cache%41"])
def test_the_default_database_is_in_the_user_cache_whatever_its_path_holds(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, folder: str
) -> None:
    """The cache dir was pasted into the URL as it is: a '?' began its query, so `cache?x`
    put the database in a file named `cache` beside it; `%41` named `cacheA`."""
    monkeypatch.delenv(DB_URL_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / folder))
    expected = tmp_path / folder / "cce_compile" / "tuning.db"
    assert sqlite_file(resolve_db_url()) == expected
    upgrade()
    assert expected.is_file() and sorted(path.name for path in tmp_path.iterdir()) == [folder]


def test_gpu_names_are_normalized() -> None:
    assert normalize_gpu_name("  NVIDIA  H100_80GB HBM3 ") == "nvidia-h100-80gb-hbm3"


def test_best_is_the_fastest_and_every_measurement_is_kept(engine: Engine) -> None:
    first = store.record_measurement(engine, measurement(10.0))
    slower = store.record_measurement(engine, measurement(12.0))
    faster = store.record_measurement(engine, measurement(8.0, config={"vocab_splits": 32}))
    assert (first.is_best, slower.is_best, faster.is_best) == (True, False, True)
    assert first.entry_id == slower.entry_id == faster.entry_id
    assert slower.best_median_ms == 10.0
    assert measurement_count(engine) == 3
    entry = lookup(engine).entry
    assert entry is not None
    assert entry.median_ms == 8.0
    assert entry.measurement_uid == faster.measurement_uid
    assert entry.config["vocab_splits"] == 32
    assert entry.speedup == pytest.approx(15.0 / 8.0)


def test_configs_are_stored_in_canonical_form(engine: Engine) -> None:
    store.record_measurement(engine, measurement(config={"forward": {"block_m": 128}}))
    config = lookup(engine).entry.config  # type: ignore[union-attr]
    assert set(config) == {"forward", "grad_logits", "grad_classifier", "grad_hidden", "slab_v", "vocab_splits",
                           "workspace_rows"}
    assert config["forward"]["block_m"] == 128
    assert config["forward"]["num_warps"] == 4


def test_a_gpu_name_with_other_properties_is_refused_and_nothing_written(engine: Engine) -> None:
    store.record_measurement(engine, measurement())
    before = store.export_jsonl(engine)
    other_sm_count = {"name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "sm_count": 114, "memory_bytes": 1}
    with pytest.raises(store.ConflictError, match="114"):
        store.record_measurement(engine, measurement(5.0, gpu=other_sm_count))
    assert store.export_jsonl(engine) == before


def test_a_measurement_sent_again_under_its_uid_is_stored_once(engine: Engine) -> None:
    """A publisher's retry of a measurement the store had committed (its answer lost) once
    appended it again: two rows of one timed run. Sent under the same uid (the service's
    Idempotency-Key), the second is the first's row; another content under that uid is refused."""
    uid = uuid.uuid4().hex
    first = store.record_measurement(engine, measurement(), uid=uid)
    again = store.record_measurement(engine, measurement(), uid=uid)
    assert (first.measurement_uid, again.measurement_uid) == (uid, uid)
    assert (first.already_stored, again.already_stored) == (False, True)
    assert (again.entry_id, again.is_best, again.best_median_ms) == (first.entry_id, True, 10.0)
    with pytest.raises(store.ConflictError, match=f"uid {uid} is stored with other median_ms.*new Idempotency-Key"):
        store.record_measurement(engine, measurement(9.0), uid=uid)
    assert measurement_count(engine) == 1 and lookup(engine).entry.median_ms == 10.0  # type: ignore[union-attr]
    assert not store.record_measurement(engine, measurement()).already_stored  # no uid: a new one, as before
    assert measurement_count(engine) == 2


def test_a_retry_racing_its_uncommitted_first_send_is_stored_once(db_url: str) -> None:
    """The retry arrives while the first send's transaction has inserted its row and not yet
    committed: the retry waits for it (PostgreSQL on the uid's unique index, SQLite on the write
    lock) and then finds the committed row, instead of adding a second or failing."""
    uid = uuid.uuid4().hex
    first_engine, retry_engine = make_engine(db_url), make_engine(db_url)
    inserted = threading.Event()

    @event.listens_for(first_engine, "after_cursor_execute")
    def _hold_the_transaction_open(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if statement.startswith("INSERT INTO measurements"):
            inserted.set()
            time.sleep(0.5)  # the retry meets the uncommitted row

    results: list[store.RecordResult] = []

    def retry() -> None:
        inserted.wait(timeout=10)
        results.append(store.record_measurement(retry_engine, measurement(), uid=uid))

    retrying = threading.Thread(target=retry)
    retrying.start()
    first = store.record_measurement(first_engine, measurement(), uid=uid)
    retrying.join(timeout=30)
    assert [result.measurement_uid for result in (first, *results)] == [uid, uid]
    assert (first.already_stored, results[0].already_stored) == (False, True)
    assert measurement_count(first_engine) == 1
    first_engine.dispose()
    retry_engine.dispose()


GPU_H100_PCIE = {"name": "NVIDIA H100 PCIe", "compute_capability": "9.0", "sm_count": 132, "memory_bytes": 1}


@pytest.mark.parametrize(
    ("stored", "asked", "level"),
    [
        ({}, {}, "exact"),
        ({"tokens": 4096}, {"tokens": 8192}, "nearest_bucket"),
        ({"tokens": 32768}, {"tokens": 8192}, "nearest_bucket"),
        ({"tokens": 65536}, {"tokens": 8192}, "none"),  # 8x away: never snap that far
        ({"tokens": 1024}, {"tokens": 8192}, "none"),
        ({}, {"triton_version": "3.6.0"}, "stale_triton"),
        ({"tokens": 4096}, {"triton_version": "3.6.0"}, "stale_triton"),
        ({"gpu": GPU_H100_PCIE}, {}, "none"),  # an unknown GPU name and no arch given
        ({"gpu": GPU_H100_PCIE}, {"compute_capability": "9.0", "sm_count": 132}, "same_arch"),
        ({"gpu": GPU_H100_PCIE}, {"compute_capability": "9.0", "sm_count": 114}, "none"),
        ({}, {"kernel_version": "other"}, "none"),
        ({}, {"V": 32000}, "none"),
        ({}, {"dtype": "float16"}, "none"),
        ({}, {"mode": "filtered"}, "none"),
    ],
)
def test_lookup_match_levels(engine: Engine, stored: dict[str, Any], asked: dict[str, Any], level: str) -> None:
    store.record_measurement(engine, measurement(**stored))
    assert lookup(engine, **asked).match_level == level


def test_lookup_uses_the_stored_arch_of_a_known_gpu(engine: Engine) -> None:
    store.record_measurement(engine, measurement(kernel_version="only-on-pcie", gpu=GPU_H100_PCIE))
    store.record_measurement(engine, measurement(kernel_version="other"))  # registers the H100 SXM
    assert lookup(engine, kernel_version="only-on-pcie").match_level == "same_arch"


def test_lookup_prefers_the_better_level_then_the_nearer_bucket(engine: Engine) -> None:
    store.record_measurement(engine, measurement(1.0, triton_version="3.4.0"))  # stale but exact bucket
    store.record_measurement(engine, measurement(2.0, tokens=32768))  # same triton, 4x away
    store.record_measurement(engine, measurement(3.0, tokens=16384))  # same triton, 2x away
    result = lookup(engine)
    assert (result.match_level, result.entry.n_bucket) == ("nearest_bucket", 16384)  # type: ignore[union-attr]
    store.record_measurement(engine, measurement(4.0, tokens=4096))  # 2x away, the other side
    assert lookup(engine).entry.n_bucket == 16384  # type: ignore[union-attr]  (a tie goes to the larger)


def test_retired_entries_are_skipped_then_replaced_by_the_next_measurement(engine: Engine) -> None:
    bogus = store.record_measurement(engine, measurement(0.002))
    retired = store.retire(engine, bogus.entry_id)
    assert retired.retired
    assert lookup(engine).match_level == "none"
    assert store.list_configs(engine, ConfigFilters())[1] == 0
    assert store.list_configs(engine, ConfigFilters(include_retired=True))[1] == 1
    replacement = store.record_measurement(engine, measurement(10.0))
    assert replacement.is_best and replacement.entry_id == bogus.entry_id
    assert lookup(engine).entry.median_ms == 10.0  # type: ignore[union-attr]
    assert measurement_count(engine) == 2


def test_an_older_export_does_not_revive_a_retired_measurement_replaced_since(engine: Engine) -> None:
    """Retire a bogus fast entry, let a measurement replace it, then import an export taken before
    the retire: once replaced, the entry no longer said it had been retired, so keep_better took
    the file's faster line and served the retired config again."""
    bogus = store.record_measurement(engine, measurement(0.002))
    before_retire = store.export_jsonl(engine)
    store.retire(engine, bogus.entry_id)
    store.record_measurement(engine, measurement(10.0))
    for mode in ("keep_better", "overwrite", "skip"):
        report = store.import_jsonl(engine, before_retire, mode=mode)
        assert (report.entries_replaced, report.entries_kept) == (0, 1), mode
        assert lookup(engine).entry.median_ms == 10.0, mode  # type: ignore[union-attr]


@pytest.mark.parametrize("database", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_an_upgrade_from_schema_0001_keeps_the_retirements_it_can_see(database: str, tmp_path: Any) -> None:
    """Schema 0001 knew a retirement only while the entry was retired: the upgrade records those
    entries' measurements, so an older export cannot revive them once they are replaced. On a
    database of its own: it downgrades the schema, which the session's shared one must not see."""
    from contextlib import nullcontext

    from alembic import command

    from tests.db_fixtures import _require_postgres
    from tuning_db.migrate import alembic_config

    if database == "postgres":
        _require_postgres()
    with (scratch_schema(POSTGRES_URL, prefix="cce_test_0001") if database == "postgres"
          else nullcontext(f"sqlite:///{tmp_path / 'old.db'}")) as url:
        upgrade(url)
        engine = make_engine(url)
        bogus = store.record_measurement(engine, measurement(0.002))
        before_retire = store.export_jsonl(engine)
        store.retire(engine, bogus.entry_id)
        with engine.begin() as connection:
            command.downgrade(alembic_config(connection), "0001")
        assert upgrade(url) == head_revision()
        store.record_measurement(engine, measurement(10.0))
        store.import_jsonl(engine, before_retire)
        assert lookup(engine).entry.median_ms == 10.0  # type: ignore[union-attr]
        engine.dispose()


def test_retiring_an_unknown_entry_is_not_found(engine: Engine) -> None:
    with pytest.raises(store.NotFoundError):
        store.retire(engine, 999)


def test_list_configs_filters_and_pages(engine: Engine) -> None:
    for tokens in (1024, 2048, 4096, 8192):
        store.record_measurement(engine, measurement(tokens=tokens))
    store.record_measurement(engine, measurement(dtype="float16"))
    page, total = store.list_configs(engine, ConfigFilters(dtype="bfloat16"), limit=3, offset=0)
    assert total == 4 and [entry.n_bucket for entry in page] == [1024, 2048, 4096]
    page, total = store.list_configs(engine, ConfigFilters(dtype="bfloat16"), limit=3, offset=3)
    assert total == 4 and [entry.n_bucket for entry in page] == [8192]
    assert store.list_configs(engine, ConfigFilters(gpu="nvidia h100 80gb hbm3", dtype="float16"))[1] == 1
    assert store.list_configs(engine, ConfigFilters(gpu="unknown"))[1] == 0


def test_list_gpus_counts_live_entries(engine: Engine) -> None:
    store.record_measurement(engine, measurement())
    store.record_measurement(engine, measurement(tokens=1024))
    retired = store.record_measurement(engine, measurement(gpu=GPU_H100_PCIE))
    store.retire(engine, retired.entry_id)
    assert [(gpu.name, gpu.entries) for gpu in store.list_gpus(engine)] == [(H100_KEY, 2), ("nvidia-h100-pcie", 0)]


def _fill(engine: Engine) -> None:
    for tokens, median_ms in ((1024, 1.0), (8192, 8.0), (65536, 60.0)):
        store.record_measurement(engine, measurement(median_ms, tokens=tokens))
        store.record_measurement(engine, measurement(median_ms * 1.5, tokens=tokens))
    store.record_measurement(engine, measurement(3.0, gpu=GPU_H100_PCIE, dtype="float32"))


def test_export_has_a_header_and_round_trips_into_an_empty_database(engine: Engine, tmp_path: Any) -> None:
    _fill(engine)
    exported = store.export_jsonl(engine)
    # 7 are stored, the file carries its entries' 4 (it said 7, and its import's export 4)
    assert json.loads(exported[0]) == {"format": "cce-tuning-db", "schema_version": 1, "entries": 4, "measurements": 4}
    target_url = f"sqlite:///{tmp_path / 'copy.db'}"
    upgrade(target_url)
    target = make_engine(target_url)
    report = store.import_jsonl(target, exported)
    assert (report.lines, report.measurements_added, report.entries_added) == (4, 4, 4)
    assert store.export_jsonl(target) == exported
    again = store.import_jsonl(target, exported)
    assert (again.measurements_added, again.entries_added, again.entries_kept) == (0, 0, 4)
    target.dispose()


def test_a_config_stored_before_a_field_existed_reimports_its_own_export(engine: Engine) -> None:
    """A config an older release stored lacks the fields added since (workspace_rows): importing
    its export back was refused, the stored config compared as stored with the line's canonical one."""
    store.record_measurement(engine, measurement())
    with engine.begin() as connection:
        config = dict(connection.scalar(select(Measurement.config)))
        del config["workspace_rows"]
        connection.execute(update(Measurement).values(config=config))
    report = store.import_jsonl(engine, store.export_jsonl(engine))
    assert (report.measurements_added, report.entries_kept) == (0, 1)


ICU_COLLATION = "und-x-icu"
TEXT_KEY_COLUMNS = {"gpus": ["name"], "best_configs": ["kernel", "kernel_version", "triton_version", "dtype", "mode"]}


def test_export_is_in_byte_order_whatever_the_collation(postgres_url: str) -> None:
    """Export ordered by the database's collation: an ICU one puts 'k0' before 'K1', the test
    database's (C) after, so the same data gave other files. The key columns here take an ICU
    collation, whatever the test database's own; the test checks that they sort otherwise.
    (`postgres_url`: skipped without a server.)"""
    with scratch_schema(POSTGRES_URL, prefix="cce_test_collation") as url:
        upgrade(url)
        engine = make_engine(url)
        with engine.begin() as connection:
            found = text("SELECT count(*) FROM pg_collation WHERE collname = :name")
            if connection.scalar(found, {"name": ICU_COLLATION}) == 0:
                pytest.skip(f"the PostgreSQL server has no {ICU_COLLATION} collation (built without ICU)")
            for table, columns in TEXT_KEY_COLUMNS.items():
                for column in columns:
                    connection.execute(
                        text(f'ALTER TABLE {table} ALTER COLUMN {column} TYPE varchar COLLATE "{ICU_COLLATION}"')
                    )
        for gpu_name, kernel_version in (("A100", "K1"), ("a-100", "k0"), ("a100 x", "Kz"), ("B1", "k.1")):
            gpu = {"name": gpu_name, "compute_capability": "8.0", "sm_count": 108, "memory_bytes": 1}
            store.record_measurement(engine, measurement(gpu=gpu, kernel_version=kernel_version))
            store.record_measurement(engine, measurement(kernel_version=kernel_version))
        with engine.connect() as connection:
            collated = connection.scalars(text("SELECT kernel_version FROM best_configs ORDER BY kernel_version")).all()
        assert collated != sorted(collated)  # the guard: the database sorts otherwise
        keys = [
            (entry["gpu"]["name"], entry["kernel"], entry["kernel_version"], entry["triton_version"], entry["V"],
             entry["D"], entry["dtype"], entry["tokens"], entry["mode"])
            for entry in map(json.loads, store.export_jsonl(engine)[1:])
        ]
        engine.dispose()
    assert len(keys) == 8 and keys == sorted(keys)  # Python's str order is UTF-8's byte order


def _exported_with(engine: Engine, median_ms: float) -> list[str]:
    """An export file holding one entry for the default key, timed at `median_ms`."""
    lines = store.export_jsonl(engine)
    entry = json.loads(lines[1])
    entry.update(median_ms=median_ms, p20_ms=median_ms, p80_ms=median_ms, measurement_uid="f" * 32)
    return [json.dumps({**json.loads(lines[0]), "entries": 1}), json.dumps(entry)]


@pytest.mark.parametrize(
    ("mode", "imported_ms", "best_after", "replaced"),
    [
        ("keep_better", 5.0, 5.0, 1),
        ("keep_better", 20.0, 10.0, 0),
        ("skip", 5.0, 10.0, 0),
        ("overwrite", 20.0, 20.0, 1),
    ],
)
def test_import_modes(engine: Engine, mode: str, imported_ms: float, best_after: float, replaced: int) -> None:
    store.record_measurement(engine, measurement(10.0))
    report = store.import_jsonl(engine, _exported_with(engine, imported_ms), mode=mode)  # type: ignore[arg-type]
    assert (report.entries_replaced, report.entries_kept, report.measurements_added) == (replaced, 1 - replaced, 1)
    assert lookup(engine).entry.median_ms == best_after  # type: ignore[union-attr]


def test_import_dry_run_reports_and_changes_nothing(engine: Engine) -> None:
    store.record_measurement(engine, measurement(10.0))
    before = store.export_jsonl(engine)
    report = store.import_jsonl(engine, _exported_with(engine, 5.0), dry_run=True)
    assert (report.entries_replaced, report.measurements_added, report.dry_run) == (1, 1, True)
    assert store.export_jsonl(engine) == before


def test_an_import_reports_its_progress_row_by_row(engine: Engine) -> None:
    """`progress(rows_written, rows)`: a measurement and a best entry a line, each counted once
    it is written, on SQLite across its batches as on PostgreSQL in one transaction."""
    lines = _import_file(store.IMPORT_BATCH_LINES + 30)
    calls: list[tuple[int, int]] = []
    report = store.import_jsonl(engine, lines, progress=lambda done, total: calls.append((done, total)))
    rows = 2 * report.lines
    assert report.lines == store.IMPORT_BATCH_LINES + 30
    assert calls == [(done, rows) for done in range(1, rows + 1)]


def test_an_import_file_may_start_with_a_byte_order_mark(engine: Engine) -> None:
    """Some Windows editors save UTF-8 with one (U+FEFF): the header was refused as not JSON."""
    store.record_measurement(engine, measurement(10.0))
    lines = _exported_with(engine, 5.0)
    report = store.import_jsonl(engine, ["\ufeff" + lines[0], *lines[1:]])
    assert (report.lines, report.entries_replaced) == (1, 1)


@pytest.mark.parametrize("line_break", ["\n", "\r\n", "\r"])
def test_an_import_file_may_end_its_lines_in_any_newline(engine: Engine, line_break: str) -> None:
    """Universal newlines, as cce import once read the file: a classic Mac's bare \r was refused
    ('trailing characters') once lines were split at \n alone."""
    store.record_measurement(engine, measurement(10.0))
    lines = _exported_with(engine, 5.0)
    data = line_break.join(lines).encode() + line_break.encode()
    report = store.import_jsonl(engine, store.decoded_lines(data))
    assert (report.lines, report.entries_replaced) == (1, 1)


class _Trickle(io.RawIOBase):
    """A stream that gives one byte a read, as a pipe may give less than asked."""

    def __init__(self, data: bytes) -> None:
        self.data = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        byte = self.data.read(1)
        buffer[:len(byte)] = byte
        return len(byte)


def test_read_lines_splits_as_universal_newlines_across_any_reads() -> None:
    """A \\r\\n split between two reads is one line break, not two (an empty line between them
    would shift every later line number)."""
    data = "a\r\nb\rc\n\u2028d\r\n\r\ne\r".encode()
    expected = ["a", "b", "c", "\u2028d", "", "e", ""]
    assert list(store.read_lines(_Trickle(data))) == expected
    assert list(store.read_lines(io.BytesIO(data))) == store.decoded_lines(data) == expected
    chunked = b"x" * (2**16 - 1) + b"\r\ny"  # the \r ends the first read, its \n starts the next
    assert [len(line) for line in store.read_lines(io.BufferedReader(io.BytesIO(chunked)))] == [2**16 - 1, 1]


def test_read_lines_names_a_bad_byte_s_line_and_offset_in_the_file() -> None:
    data = b"first\nsecond \xff line\n"
    with pytest.raises(store.ImportFormatError, match=r"line 2: not UTF-8 text at byte 13 of the file"):
        list(store.read_lines(_Trickle(data)))


def _bad_import_files(valid: list[str]) -> dict[str, tuple[list[str], int]]:
    header, entry = valid[0], json.loads(valid[1])
    second = dict(entry, measurement_uid="e" * 32, tokens=1024)
    two = json.dumps({**json.loads(header), "entries": 2})
    conflicting_gpu = dict(second, gpu=dict(entry["gpu"], sm_count=7))
    return {
        "bad config": ([two, json.dumps(second), json.dumps(dict(entry, config={"slab_v": 100}))], 3),
        "unknown key": ([two, json.dumps(second), json.dumps(dict(entry, extra=1))], 3),
        "not json": ([two, json.dumps(second), "{not json"], 3),
        "gpu conflict found while writing": ([two, json.dumps(second), json.dumps(conflicting_gpu)], 3),
        "newer schema": ([json.dumps({**json.loads(header), "schema_version": 2}), json.dumps(entry)], 1),
        "truncated file": ([two, json.dumps(second)], 1),
        "empty": ([], 1),
    }


@pytest.mark.parametrize(
    "case",
    ["bad config", "unknown key", "not json", "gpu conflict found while writing", "newer schema", "truncated file", "empty"],
)
def test_a_bad_import_file_changes_nothing(engine: Engine, case: str) -> None:
    store.record_measurement(engine, measurement(10.0))
    before = store.export_jsonl(engine)
    lines, line_number = _bad_import_files(_exported_with(engine, 5.0))[case]
    with pytest.raises(store.ImportFormatError) as raised:
        store.import_jsonl(engine, lines)
    assert raised.value.line_number == line_number
    assert store.export_jsonl(engine) == before


@pytest.mark.parametrize("schema_version", [True, 1.0, "1"])
def test_a_header_schema_version_is_the_integer_1_not_what_compares_equal(schema_version: object) -> None:
    """Literal[1] took true and 1.0 (they compare equal to 1) in a strict model: a header naming
    no schema version was read as version 1, where every other field is strict (true is not 1)."""
    header = json.dumps({"format": "cce-tuning-db", "schema_version": schema_version, "entries": 0, "measurements": 0})
    with pytest.raises(store.ImportFormatError, match="schema_version"):
        store._parse_export([header])


@pytest.mark.parametrize(
    ("line_number", "key", "value"), [(1, "entries", "1"), (2, "median_ms", "9.9"), (2, "sm_count", "7")]
)
def test_an_import_naming_a_key_twice_is_refused_naming_it(
    engine: Engine, line_number: int, key: str, value: str
) -> None:
    """JSON parsers keep the last of a repeated key, silently: such a line (or header, or GPU
    object) was imported with the later value, unseen."""
    store.record_measurement(engine, measurement(10.0))
    before = store.export_jsonl(engine)
    lines = _exported_with(engine, 5.0)
    given_twice = re.sub(f'"{key}": [^,}}]+', lambda given: f'{given[0]}, "{key}": {value}', lines[line_number - 1])
    lines[line_number - 1] = given_twice
    with pytest.raises(store.ImportFormatError) as raised:
        store.import_jsonl(engine, lines)
    assert raised.value.line_number == line_number and f"the key '{key}' is given twice" in str(raised.value)
    assert store.export_jsonl(engine) == before


@pytest.mark.parametrize("line_number", [1, 2])
def test_an_integer_past_pythons_digit_limit_is_a_format_error(engine: Engine, line_number: int) -> None:
    """json.loads raises a bare ValueError on an integer of more than 4300 digits: the repeated-key
    check let it escape the import (a 500 from the service, a line without the file's from the
    CLI); pydantic names it as any bad JSON, on its line."""
    store.record_measurement(engine, measurement(10.0))
    before = store.export_jsonl(engine)
    lines = _exported_with(engine, 5.0)
    key = "entries" if line_number == 1 else "median_ms"
    lines[line_number - 1] = re.sub(f'"{key}": [^,}}]+', f'"{key}": {"9" * 5000}', lines[line_number - 1])
    with pytest.raises(store.ImportFormatError) as raised:
        store.import_jsonl(engine, lines)
    assert raised.value.line_number == line_number and "Invalid JSON" in str(raised.value)
    assert store.export_jsonl(engine) == before


def _import_file(count: int, gpu_of: dict[int, dict[str, Any]] | None = None, **created_at_of: str) -> list[str]:
    """An export file of `count` lines, each its own key (so they fill several batches),
    created at 2026-01-01 UTC unless `created_at_of` names the line ("line_7": ...);
    `gpu_of` gives some lines (by line number) another GPU."""
    lines = [
        json.dumps(
            measurement_data(
                V=number,
                gpu=(gpu_of or {}).get(number, GPU_H100),
                measurement_uid=f"{number:032x}",
                created_at=created_at_of.get(f"line_{number}", "2026-01-01T00:00:00Z"),
            )
        )
        for number in range(2, count + 2)
    ]
    header = {"format": "cce-tuning-db", "schema_version": 1, "entries": count, "measurements": count}
    return [json.dumps(header), *lines]


@pytest.mark.parametrize("created_at", ["9999-12-31T23:59:59-01:00", "0001-01-01T00:00:00+01:00"])
@pytest.mark.parametrize("dry_run", [False, True])
def test_an_import_created_at_outside_the_storable_range_is_refused_before_writing(
    engine: Engine, created_at: str, dry_run: bool
) -> None:
    """A valid datetime whose UTC time leaves years 1..9999 once failed on PostgreSQL in a
    later batch ('timestamp too large'), after the earlier batches had committed."""
    bad_line = store.IMPORT_BATCH_LINES + 41
    lines = _import_file(store.IMPORT_BATCH_LINES + 50, **{f"line_{bad_line}": created_at})
    with pytest.raises(store.ImportFormatError) as raised:
        store.import_jsonl(engine, lines, dry_run=dry_run)
    assert raised.value.line_number == bad_line
    assert "created_at" in str(raised.value)
    assert measurement_count(engine) == 0


def test_an_import_checks_every_gpu_it_names_past_one_query_of_them(engine: Engine) -> None:
    """The stored GPUs an import names are looked up IN_QUERY_CHUNK names a query (one query of
    them all failed on PostgreSQL past 65,535 names): a conflict with the last name, in the
    last query and the last batch, is still refused before any batch is written."""
    count = max(store.IN_QUERY_CHUNK, store.IMPORT_BATCH_LINES) + 5
    last = {"name": f"GPU {count + 1:05}", "compute_capability": "9.0", "sm_count": 132, "memory_bytes": 1}
    store.record_measurement(engine, measurement(gpu=last))
    before = store.export_jsonl(engine)
    gpus = {number: {**last, "name": f"GPU {number:05}"} for number in range(2, count + 2)}
    gpus[count + 1] = {**last, "sm_count": 114}
    with pytest.raises(store.ImportFormatError, match="114") as raised:
        store.import_jsonl(engine, _import_file(count, gpu_of=gpus))
    assert raised.value.line_number == count + 1
    assert store.export_jsonl(engine) == before


@pytest.mark.parametrize(
    ("created_at", "exported_as"),
    [
        ("2025-06-01T12:00:00+05:00", "2025-06-01T07:00:00Z"),
        ("2025-06-01T12:00:00-03:30", "2025-06-01T15:30:00Z"),
        ("2025-06-01T12:00:00", "2025-06-01T12:00:00Z"),  # no offset: UTC, on both databases
        ("0001-01-02T00:00:00+00:00", "0001-01-02T00:00:00Z"),
        ("9999-12-30T23:59:59Z", "9999-12-30T23:59:59Z"),
    ],
)
def test_an_imported_created_at_is_kept_as_the_same_moment(engine: Engine, created_at: str, exported_as: str) -> None:
    """SQLite once dropped the offset (12:00+05:00 came back as 12:00Z, 5 hours off)."""
    store.import_jsonl(engine, _import_file(1, line_2=created_at))
    assert json.loads(store.export_jsonl(engine)[1])["created_at"] == exported_as


def test_an_import_that_fails_while_writing_leaves_nothing_on_postgres(postgres_url: str) -> None:
    """On PostgreSQL the import is one transaction: a failure past the first batch's worth of
    lines (here a concurrent writer that stores the uid of a late line with other content,
    after the check against the store) rolls back the lines before it too; it once left
    them committed."""
    engine, racer = make_engine(postgres_url), make_engine(postgres_url)
    late_line = store.IMPORT_BATCH_LINES + 41
    lines = _import_file(store.IMPORT_BATCH_LINES + 50)
    other_gpu = {"name": "Racing GPU", "compute_capability": "8.0", "sm_count": 108, "memory_bytes": 1}
    racing_line = {**json.loads(lines[late_line - 1]), "gpu": other_gpu}
    racing = [json.dumps({**json.loads(lines[0]), "entries": 1}), json.dumps(racing_line)]
    measurement_inserts: list[int] = []

    @event.listens_for(engine, "before_cursor_execute")
    def _store_its_uid_differently_first(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if statement.startswith("INSERT INTO measurements"):
            measurement_inserts.append(1)
            if len(measurement_inserts) == late_line - 1:  # the late line's, after the earlier lines' writes
                store.import_jsonl(racer, racing)

    with pytest.raises(store.ImportFormatError) as raised:
        store.import_jsonl(engine, lines)
    assert raised.value.line_number == late_line
    assert measurement_count(engine) == 1  # the racer's only
    engine.dispose()
    racer.dispose()


def test_an_sqlite_import_stopped_by_a_later_batch_says_what_it_imported(sqlite_url: str) -> None:
    """On SQLite the batches before a failing one stay (documented); the error once said
    nothing was imported. The racer registers the late line's GPU differently right after the
    first batch commits."""
    engine, racer = make_engine(sqlite_url), make_engine(sqlite_url)
    other_gpu = {"name": "Racing GPU", "compute_capability": "8.0", "sm_count": 108, "memory_bytes": 1}
    late_line = store.IMPORT_BATCH_LINES + 41
    lines = _import_file(store.IMPORT_BATCH_LINES + 50, gpu_of={late_line: other_gpu})

    @event.listens_for(engine, "commit")
    def _register_it_differently_after_the_first_batch(_conn: Any) -> None:
        if measurement_count(racer) == 0:
            store.record_measurement(racer, measurement(gpu=dict(other_gpu, sm_count=7)))

    with pytest.raises(store.ImportFormatError) as raised:
        store.import_jsonl(engine, lines)
    imported = measurement_count(engine) - 1  # less the racer's
    assert imported > 0 and raised.value.lines_imported == imported
    assert raised.value.line_number == late_line
    assert f"the {imported} lines before its batch were imported" in str(raised.value)
    engine.dispose()
    racer.dispose()


def test_an_sqlite_import_stopped_by_a_lock_in_a_later_batch_says_what_it_imported(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another writer holds the lock past the busy timeout from the first batch's commit on:
    the database error once said nothing of the lines already stored."""
    monkeypatch.setattr(engine_module, "SQLITE_BUSY_TIMEOUT_MS", 200)
    engine = make_engine(sqlite_url)
    holder = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), isolation_level=None, check_same_thread=False)

    checkins: list[int] = []

    @event.listens_for(engine.pool, "checkin")
    def _lock_once_the_first_batch_is_in(*_args: Any) -> None:
        checkins.append(1)
        if len(checkins) == 2:  # the check against the store's connection, then the first batch's
            holder.execute("BEGIN IMMEDIATE")

    try:
        with pytest.raises(store.ImportInterrupted) as raised:
            store.import_jsonl(engine, _import_file(store.IMPORT_BATCH_LINES + 50))
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    imported = measurement_count(engine)
    assert 0 < imported < store.IMPORT_BATCH_LINES + 50 and raised.value.lines_imported == imported
    assert f"after {imported} of {store.IMPORT_BATCH_LINES + 50} lines were imported" in str(raised.value)
    engine.dispose()


def _lines_for(keys: list[int], median_ms: float) -> list[str]:
    """An export file with one new measurement, timed at `median_ms`, for each V in `keys`, in that order."""
    lines = [
        json.dumps(
            measurement_data(V=v, median_ms=median_ms, p20_ms=median_ms, p80_ms=median_ms,
                             measurement_uid=uuid.uuid4().hex, created_at="2026-01-01T00:00:00Z")
        )
        for v in keys
    ]
    header = {"format": "cce-tuning-db", "schema_version": 1, "entries": len(keys), "measurements": len(keys)}
    return [json.dumps(header), *lines]


def test_concurrent_imports_and_measurements_queue_instead_of_deadlocking(postgres_url: str) -> None:
    """Two imports of the same two keys, their lines in other orders, and a measurement on one
    key. Each import once wrote its best entries in file order, so each held one the other waited
    for: PostgreSQL killed one of them, and the measurement queued between them (the service's
    POST answered 503, and `cce tune --publish` lost it). Each import here pauses 0.3 s after
    its first entry once the other has written its own (or a second has passed: the other waits
    for it); the measurement is sent as they pause."""
    engine = make_engine(postgres_url)
    for v in (1001, 1002):
        store.record_measurement(engine, measurement(20.0, V=v))
    first_entry = [threading.Event(), threading.Event()]
    errors: list[str] = []

    def import_lines(index: int, keys: list[int], median_ms: float) -> None:
        importer = make_engine(postgres_url)

        @event.listens_for(importer, "after_cursor_execute")
        def _pause_after_the_first_entry(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
            if statement.startswith("INSERT INTO best_configs") and not first_entry[index].is_set():
                first_entry[index].set()
                first_entry[1 - index].wait(timeout=1)
                time.sleep(0.3)

        try:
            store.import_jsonl(importer, _lines_for(keys, median_ms))
        except Exception as error:  # noqa: BLE001 - the test reports every failure
            errors.append(f"import {index}: {error!r}"[:200])
        finally:
            importer.dispose()

    def post() -> None:
        first_entry[0].wait(timeout=5)
        first_entry[1].wait(timeout=0.5)
        try:
            store.record_measurement(engine, measurement(1.0, V=1002))
        except Exception as error:  # noqa: BLE001
            errors.append(f"measurement: {error!r}"[:200])

    threads = [
        threading.Thread(target=import_lines, args=(0, [1001, 1002], 5.0)),
        threading.Thread(target=import_lines, args=(1, [1002, 1001], 6.0)),
        threading.Thread(target=post),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []
    assert measurement_count(engine) == 7
    assert [lookup(engine, V=v).entry.median_ms for v in (1001, 1002)] == [5.0, 1.0]  # type: ignore[union-attr]
    engine.dispose()


def test_a_retire_while_an_import_runs_is_not_undone_by_it(postgres_url: str) -> None:
    """An export taken before a retire is imported while an admin retires the entry and a newer
    measurement replaces it. The import read the retired measurements before writing its best
    entries: the retire, committed in between, went unseen, and the file's line (faster than
    the newer measurement) made the retired config the best again. The import pauses before
    its first best entry until the retire and the measurement are done (or a second has
    passed: they wait for the import)."""
    engine = make_engine(postgres_url)
    bogus = store.record_measurement(engine, measurement(0.002))
    before_retire = store.export_jsonl(engine)
    importer = make_engine(postgres_url)
    replaced = threading.Event()

    def retire_and_replace() -> None:
        store.retire(engine, bogus.entry_id)
        store.record_measurement(engine, measurement(10.0))
        replaced.set()

    admin = threading.Thread(target=retire_and_replace)

    @event.listens_for(importer, "before_cursor_execute")
    def _pause_before_the_first_entry(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if statement.startswith("INSERT INTO best_configs") and admin.ident is None:
            admin.start()
            replaced.wait(timeout=1)

    store.import_jsonl(importer, before_retire)
    admin.join(timeout=30)
    assert replaced.is_set()
    assert lookup(engine).entry.median_ms == 10.0  # type: ignore[union-attr]
    importer.dispose()
    engine.dispose()


def test_a_retry_whose_entry_was_retired_is_not_the_best(engine: Engine) -> None:
    """A retry under its Idempotency-Key after an admin retired its entry (nothing has replaced
    it yet) answered is_best: true, though lookups skip the entry."""
    uid = uuid.uuid4().hex
    first = store.record_measurement(engine, measurement(8.0), uid)
    store.retire(engine, first.entry_id)
    again = store.record_measurement(engine, measurement(8.0), uid)
    assert again.already_stored and again.entry_id == first.entry_id
    assert not again.is_best
