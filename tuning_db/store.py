"""The operations on the tuning database (the service's and the CLI's only way in).

Writes go through `write_session` (one transaction each; an import on SQLite one per batch
of lines).
A measurement is appended, then
the key's best entry is changed by a single INSERT ... ON CONFLICT DO UPDATE ... WHERE the
new time is faster (or the entry is retired): the database compares the times under its
own row lock, so concurrent writers can never lose the faster one.
"""

from __future__ import annotations

import io
import math
import re
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime, timezone
from typing import Any, BinaryIO, TypeVar

from pydantic import ValidationError
from pydantic_core import to_json
from sqlalchemy import ColumnElement, Engine, Row, and_, bindparam, func, or_, select, tuple_, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from cce_compile.config.keys import n_bucket
from tuning_db.engine import read_session, write_session
from tuning_db.models import BEST_KEY_COLUMNS, BestConfig, Gpu, Measurement, RetiredMeasurement
from tuning_db.records import (
    MATCH_LEVELS,
    MAX_RECORD_CHARS,
    MAX_REPORTED_ERRORS,
    NEAREST_BUCKET_FACTOR,
    BestEntry,
    ConfigFilters,
    ExportHeader,
    ExportLine,
    GpuSpec,
    GpuSummary,
    ImportMode,
    ImportReport,
    LookupQuery,
    LookupResult,
    MatchLevel,
    MeasurementIn,
    RecordResult,
    RepeatedKeyError,
    as_utc,
    canonical_config,
    clip,
    validate_json,
)


class StoreError(Exception):
    """A request the store refuses; nothing was written."""


class NotFoundError(StoreError):
    pass


class ConflictError(StoreError):
    """The data contradicts what the store holds (e.g. a GPU name with other properties)."""


class ImportFormatError(StoreError):
    """A line of an import file that cannot be imported. `lines_imported` counts the lines
    written before it: 0 but where an SQLite import's later batch met a concurrent writer."""

    def __init__(self, line_number: int, message: str, lines_imported: int = 0) -> None:
        super().__init__(f"line {line_number}: {message}")
        self.line_number = line_number
        self.reason = message
        self.lines_imported = lines_imported


class ImportInterrupted(StoreError):
    """An SQLite import whose later batch the database failed (a lock held past its busy
    timeout, a full disk): the batches before it stay, which the message says."""

    def __init__(self, lines_imported: int, lines: int, error: DBAPIError) -> None:
        super().__init__(f"the database failed after {lines_imported} of {lines} lines were imported ({error.orig}); "
                         "import the file again, it adds nothing twice")
        self.lines_imported = lines_imported
        self.error = error


class ImportStopped(KeyboardInterrupt):
    """A Ctrl-C (KeyboardInterrupt) during an SQLite import after its first batches committed:
    they stay, which the message says (one landing between a batch's commit and its count
    leaves that batch out of the number); still a KeyboardInterrupt to whoever does not look."""

    def __init__(self, lines_imported: int, lines: int) -> None:
        super().__init__(f"interrupted after {lines_imported} of {lines} lines were imported (SQLite takes a file "
                         "in batches); import the file again to finish, it adds nothing twice")
        self.lines_imported = lines_imported


_FILTER_COLUMNS: dict[str, Any] = {
    "gpu": Gpu.name,
    "kernel": BestConfig.kernel,
    "kernel_version": BestConfig.kernel_version,
    "triton_version": BestConfig.triton_version,
    "V": BestConfig.v,
    "D": BestConfig.d,
    "dtype": BestConfig.dtype,
    "mode": BestConfig.mode,
}
_SHAPE_COLUMNS = {"V": "v", "D": "d"}
"""MeasurementIn's shape fields and their (lower-case) measurements columns."""
_MEASUREMENT_COLUMNS = {
    name: _SHAPE_COLUMNS.get(name, name) for name in MeasurementIn.model_fields if name != "gpu"
}
"""MeasurementIn's fields and the measurements columns behind them (the GPU is a join)."""
_BEST_VALUE_COLUMNS = ("median_ms", "measurement_id", "retired", "updated_at")
IMPORT_BATCH_LINES = 200
"""Lines per import transaction on SQLite: a large file must not hold its write lock (one
for the whole database) for longer than other writers wait for it (busy timeout), so it
commits every batch. PostgreSQL locks rows, not the database: there an import is one
transaction, all lines or none."""
SQLITE_BATCH_PAUSE_S = 0.15
"""The import's pause between batches on SQLite. Its lock is not fair: a waiting writer
polls (every 100 ms once it has waited a while), so an importer that begins its next batch
right after a commit would keep the lock for the whole file. The pause lets one poll in."""
IN_QUERY_CHUNK = 500
"""Values per IN (...) when an import looks for the GPUs and measurements it already holds: one
list of them all exceeded PostgreSQL's 65,535 parameters a statement."""


T = TypeVar("T")


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _dialect_insert(session: Session) -> Callable[..., Any]:
    """The insert with ON CONFLICT support for the session's database."""
    return {"sqlite": sqlite.insert, "postgresql": postgresql.insert}[session.get_bind().dialect.name]


def _equal_to(values: Mapping[str, Any]) -> list[ColumnElement[bool]]:
    return [_FILTER_COLUMNS[name] == value for name, value in values.items() if value is not None]


def _same_key(measurement: Measurement) -> list[ColumnElement[bool]]:
    return [getattr(BestConfig, column) == getattr(measurement, column) for column in BEST_KEY_COLUMNS]


def _gpu_id(session: Session, spec: GpuSpec) -> int:
    """The GPU's id, registering it on first sight (race-free: insert-or-nothing, then read)."""
    insert = _dialect_insert(session)
    session.execute(insert(Gpu).values(spec.model_dump()).on_conflict_do_nothing(index_elements=["name"]))
    gpu = session.scalars(select(Gpu).where(Gpu.name == spec.name)).one()
    _check_gpu(gpu, spec)
    return gpu.id


def _check_gpu(gpu: Gpu, spec: GpuSpec) -> None:
    """Raise ConflictError if the registered GPU of this name has other properties."""
    if (gpu.compute_capability, gpu.sm_count) != (spec.compute_capability, spec.sm_count):
        raise ConflictError(
            f"GPU {spec.name!r} is registered with compute capability {gpu.compute_capability} and "
            f"{gpu.sm_count} SMs, not {spec.compute_capability} and {spec.sm_count}"
        )


IMPORT_UID_FIX = "give an edited line a new uid"
"""What an import's line does about a uid stored with other content."""


def _add_measurement(
    session: Session, measurement: MeasurementIn, gpu_id: int, uid: str, created_at: datetime,
    fix: str = IMPORT_UID_FIX,
) -> tuple[Measurement, bool]:
    """Append a measurement of the GPU `gpu_id` unless one with this uid exists; returns the
    stored row and whether it was added (a re-imported file, a retried POST, adds nothing
    twice). A stored uid with other content is a ConflictError saying `fix`: a uid names one
    measurement. The insert-or-nothing is the database's: a concurrent writer of the same uid
    waits for the first to commit (its unique index on PostgreSQL, the write lock on SQLite)."""
    fields = measurement.model_dump(include=set(_MEASUREMENT_COLUMNS))
    values = {_MEASUREMENT_COLUMNS[name]: value for name, value in fields.items()}
    values |= {"uid": uid, "gpu_id": gpu_id, "n_bucket": n_bucket(measurement.tokens), "created_at": created_at}
    insert = _dialect_insert(session)
    added = session.scalars(
        insert(Measurement).values(values).on_conflict_do_nothing(index_elements=["uid"]).returning(Measurement)
    ).one_or_none()
    if added is not None:
        return added, True
    stored = session.scalars(select(Measurement).where(Measurement.uid == uid)).one()
    _check_same_content(stored, measurement, same_gpu=stored.gpu_id == gpu_id, fix=fix)
    return stored, False


def _check_same_content(
    stored: Measurement, measurement: MeasurementIn, same_gpu: bool, fix: str = IMPORT_UID_FIX
) -> None:
    """Raise ConflictError, saying `fix`, unless the stored measurement of this uid is `measurement`."""
    stored_fields = {name: getattr(stored, column) for name, column in _MEASUREMENT_COLUMNS.items()}
    stored_fields["config"] = _today_form(stored.config)
    differing = [] if same_gpu else ["gpu"]
    differing += [name for name, value in stored_fields.items() if value != getattr(measurement, name)]
    if differing:
        raise ConflictError(
            f"measurement uid {stored.uid} is stored with other {', '.join(differing)}: a uid names one "
            f"measurement ({fix})"
        )


def _today_form(config: Any) -> Any:
    """A stored config as today's release stores it, to compare with an incoming (canonical) one:
    an older release's lacks the fields added since (workspace_rows). One today's rules refuse
    stays as stored, so it differs from any incoming config."""
    try:
        return canonical_config(config)
    except ValueError:
        return config


def _upsert_best(session: Session, measurement: Measurement, mode: ImportMode) -> bool:
    """Point the key's best entry at `measurement` if `mode` says so, in one statement;
    returns whether it did. keep_better: only when faster than the live entry. An entry that
    already points at `measurement` is left alone (a re-import replaces nothing, and does
    not revive a retired entry)."""
    insert = _dialect_insert(session)
    statement = insert(BestConfig).values(
        **{column: getattr(measurement, column) for column in BEST_KEY_COLUMNS},
        median_ms=measurement.median_ms,
        measurement_id=measurement.id,
        retired=False,
        updated_at=_now(),
    )
    if mode == "skip":
        statement = statement.on_conflict_do_nothing(index_elements=list(BEST_KEY_COLUMNS))
    else:
        other_measurement = BestConfig.measurement_id != statement.excluded.measurement_id
        faster_or_retired = or_(statement.excluded.median_ms < BestConfig.median_ms, BestConfig.retired)
        statement = statement.on_conflict_do_update(
            index_elements=list(BEST_KEY_COLUMNS),
            set_={column: statement.excluded[column] for column in _BEST_VALUE_COLUMNS},
            where=other_measurement if mode == "overwrite" else and_(other_measurement, faster_or_retired),
        )
    return session.execute(statement.returning(BestConfig.id)).scalar_one_or_none() is not None


_ENTRIES = (
    select(
        BestConfig.id.label("entry_id"),
        BestConfig.n_bucket,
        BestConfig.updated_at,
        BestConfig.retired,
        Gpu.name.label("gpu_name"),
        Gpu.compute_capability,
        Gpu.sm_count,
        Gpu.memory_bytes,
        Measurement.uid.label("measurement_uid"),
        Measurement.created_at.label("measured_at"),
        *(getattr(Measurement, column) for column in _MEASUREMENT_COLUMNS.values()),
    )
    .join(Gpu, BestConfig.gpu_id == Gpu.id)
    .join(Measurement, BestConfig.measurement_id == Measurement.id)
)
"""Best entries with their GPU and source measurement, one flat row each (no ORM objects:
a lookup is on the hot path of every node's first launch)."""


def _measurement_fields(row: Row[Any]) -> dict[str, Any]:
    """An _ENTRIES row's measurement as MeasurementIn's fields, as stored (not re-validated)."""
    values = row._mapping
    return {
        "gpu": {
            "name": row.gpu_name,
            "compute_capability": row.compute_capability,
            "sm_count": row.sm_count,
            "memory_bytes": row.memory_bytes,
        },
        **{name: values[column] for name, column in _MEASUREMENT_COLUMNS.items()},
    }


def _finite(value: float) -> float | None:
    """`value`, or None where it is not finite: a row the first release stored (it took any
    positive time, 5e-324 ms) is served as it is, and its speedup overflows to infinity, which
    JSON cannot carry (it was answered as null where the schema declared a number)."""
    return value if math.isfinite(value) else None


def _entry(row: Row[Any]) -> BestEntry:
    return BestEntry(
        **_measurement_fields(row),
        entry_id=row.entry_id,
        n_bucket=row.n_bucket,
        speedup=_finite(row.default_ms / row.median_ms),
        measurement_uid=row.measurement_uid,
        measured_at=as_utc(row.measured_at),
        updated_at=as_utc(row.updated_at),
        retired=row.retired,
    )


RETRY_UID_FIX = "a retry sends the same measurement; send another one under a new Idempotency-Key"
"""What a client does about a uid (its Idempotency-Key) stored with other content."""
_UID = re.compile(r"[0-9a-f]{32}")


def record_measurement(engine: Engine, measurement: MeasurementIn, uid: str | None = None) -> RecordResult:
    """Append one measurement and make it the key's best if it is the fastest, atomically.

    `uid` (32 lowercase hex digits) is the client's name for this measurement, the same on
    every send of it: a send whose first one was stored (its answer lost, or a 503 from a
    gateway after the commit) adds nothing and answers for the stored row. Without it the
    measurement gets a new uid, so each call appends one."""
    if uid is not None and not _UID.fullmatch(uid):
        raise ValueError(f"a measurement uid is 32 lowercase hex digits, not {clip(uid)!r}")
    with write_session(engine) as session:  # the lock order of _write_lines, one row of each
        row, added = _add_measurement(
            session, measurement, _gpu_id(session, measurement.gpu), uid or uuid.uuid4().hex, _now(), RETRY_UID_FIX
        )
        if added:  # a retry adds nothing: its first send's upsert committed with it, and the key's entry
            # may have moved on since (retired, then replaced): running it again revived a retired config
            _upsert_best(session, row, "keep_better")
        best_id, best_measurement_id, best_median_ms, retired = session.execute(
            select(BestConfig.id, BestConfig.measurement_id, BestConfig.median_ms, BestConfig.retired)
            .where(*_same_key(row))
        ).one()
        return RecordResult(
            measurement_uid=row.uid,
            entry_id=best_id,
            is_best=best_measurement_id == row.id and not retired,  # a retry after its entry's retire
            best_median_ms=best_median_ms,
            already_stored=not added,
        )


def _match_level(row: Row[Any], query: LookupQuery, bucket: int) -> MatchLevel:
    if row.gpu_name != query.gpu:
        return "same_arch"
    if row.triton_version != query.triton_version:
        return "stale_triton"
    return "exact" if row.n_bucket == bucket else "nearest_bucket"


_named_gpu = Gpu.__table__.alias("named_gpu")
_LOOKUP = _ENTRIES.where(
    *(getattr(BestConfig, column) == bindparam(column) for column in ("kernel", "kernel_version", "dtype", "mode")),
    BestConfig.v == bindparam("V"),
    BestConfig.d == bindparam("D"),
    BestConfig.retired.is_(False),
    BestConfig.n_bucket.between(bindparam("min_bucket"), bindparam("max_bucket")),
    or_(
        Gpu.name == bindparam("gpu"),
        # Same architecture: the one the query gives, or the one stored for the named GPU.
        and_(Gpu.compute_capability == bindparam("compute_capability"), Gpu.sm_count == bindparam("sm_count")),
        tuple_(Gpu.compute_capability, Gpu.sm_count).in_(
            select(_named_gpu.c.compute_capability, _named_gpu.c.sm_count).where(_named_gpu.c.name == bindparam("gpu"))
        ),
    ),
)
"""Every candidate of a lookup in one statement, built once (only parameters change)."""


def lookup(engine: Engine, query: LookupQuery) -> LookupResult:
    """The best live config for a launch, with how closely it matches (see MATCH_LEVELS).

    Only entries of the same kernel version, V, D, dtype and mode whose token bucket is
    within NEAREST_BUCKET_FACTOR qualify; among them the better match level wins, then the
    nearer bucket (the larger one on a tie), then the same Triton, then the newest.
    """
    bucket = n_bucket(query.tokens)
    parameters = query.model_dump(exclude={"tokens", "triton_version"}) | {
        "min_bucket": bucket // NEAREST_BUCKET_FACTOR,
        "max_bucket": bucket * NEAREST_BUCKET_FACTOR,
    }
    with read_session(engine) as session:
        candidates = session.execute(_LOOKUP, parameters).all()
    if not candidates:
        return LookupResult(match_level="none", n_bucket=bucket, entry=None)

    def rank(row: Row[Any]) -> tuple[Any, ...]:
        return (
            MATCH_LEVELS.index(_match_level(row, query, bucket)),
            abs(row.n_bucket.bit_length() - bucket.bit_length()),
            row.triton_version != query.triton_version,
            -row.n_bucket,
            -as_utc(row.updated_at).timestamp(),
            row.entry_id,
        )

    chosen = min(candidates, key=rank)
    return LookupResult(match_level=_match_level(chosen, query, bucket), n_bucket=bucket, entry=_entry(chosen))


def list_configs(
    engine: Engine, filters: ConfigFilters, limit: int = 100, offset: int = 0
) -> tuple[list[BestEntry], int]:
    """A page of best entries matching `filters` (extra fields of a subclass are ignored),
    in id order, and the total count."""
    conditions = _equal_to(filters.model_dump(include=set(_FILTER_COLUMNS)))
    if not filters.include_retired:
        conditions.append(BestConfig.retired.is_(False))
    matching = _ENTRIES.where(*conditions)
    with read_session(engine, snapshot=True) as session:
        total = session.scalar(select(func.count()).select_from(matching.subquery()))
        page = session.execute(matching.order_by(BestConfig.id).limit(limit).offset(offset)).all()
    return [_entry(row) for row in page], total or 0


def list_gpus(engine: Engine) -> list[GpuSummary]:
    live_entries = func.count(BestConfig.id)
    with read_session(engine) as session:
        rows = session.execute(
            select(Gpu, live_entries)
            .outerjoin(BestConfig, and_(BestConfig.gpu_id == Gpu.id, BestConfig.retired.is_(False)))
            .group_by(Gpu.id)
            .order_by(Gpu.name)
        ).all()
        return [
            GpuSummary(
                name=gpu.name,
                compute_capability=gpu.compute_capability,
                sm_count=gpu.sm_count,
                memory_bytes=gpu.memory_bytes,
                entries=entries,
            )
            for gpu, entries in rows
        ]


def retire(engine: Engine, entry_id: int) -> BestEntry:
    """Flag a best entry as bad: lookups skip it, the key's next measurement replaces it, and
    its measurement never becomes a best entry again (an import that carries it leaves its key
    alone)."""
    with write_session(engine) as session:
        now = _now()
        flagged = session.execute(
            update(BestConfig)
            .where(BestConfig.id == entry_id)
            .values(retired=True, updated_at=now)
            .returning(BestConfig.measurement_id)
        ).scalar_one_or_none()
        if flagged is None:
            raise NotFoundError(f"no config entry {entry_id}")
        insert = _dialect_insert(session)
        session.execute(
            insert(RetiredMeasurement).values(measurement_id=flagged, retired_at=now).on_conflict_do_nothing()
        )
        return _entry(session.execute(_ENTRIES.where(BestConfig.id == entry_id)).one())


def _key_order(row: Row[Any]) -> tuple[Any, ...]:
    """An _ENTRIES row's key (BEST_KEY_COLUMNS, with the GPU by name), compared in Python: by
    code point, which is UTF-8's byte order, whatever the database's collation."""
    return (row.gpu_name, *(getattr(row, column) for column in BEST_KEY_COLUMNS[1:]))


def export_jsonl(engine: Engine) -> list[str]:
    """The live best entries as JSON lines, after a header line; one consistent snapshot,
    in key order, so two exports of the same data are identical (on any database)."""
    with read_session(engine, snapshot=True) as session:
        live = sorted(session.execute(_ENTRIES.where(BestConfig.retired.is_(False))).all(), key=_key_order)
        # What the file carries (the history stays behind), so a round trip keeps the header.
        header = ExportHeader(entries=len(live), measurements=len({row.measurement_uid for row in live}))
        # ExportLine's fields in its order, serialized as stored: a row that today's rules
        # refuse is exported as it is (the importer names its line), never breaks the export.
        lines = [
            to_json(
                {
                    **_measurement_fields(row),
                    "measurement_uid": row.measurement_uid,
                    "created_at": as_utc(row.measured_at),
                },
                inf_nan_mode="null",
            ).decode()
            for row in live
        ]
        return [header.model_dump_json(), *lines]


def _validation_message(error: ValidationError | RepeatedKeyError) -> str:
    """The first errors' places and messages, clipped: the input may be megabytes long."""
    if isinstance(error, RepeatedKeyError):
        return str(error)
    errors = error.errors()
    shown = "; ".join(
        f"{clip('.'.join(map(str, item['loc'])) or 'line')}: {clip(item['msg'])}"
        for item in errors[:MAX_REPORTED_ERRORS]
    )
    return shown if len(errors) <= MAX_REPORTED_ERRORS else f"{shown}; and {len(errors) - MAX_REPORTED_ERRORS} more"


ImportLine = tuple[int, ExportLine]
"""A validated export line and its line number in the file."""


_LINE_BREAK = re.compile(rb"\r\n|\r|\n")
"""What ends a line of an export file: Python's universal newlines (\n, \r\n, a classic Mac's
\r), not str.splitlines', which also splits at characters JSON text may hold raw (U+2028).
Matched in the bytes: in UTF-8 these never occur inside another character's."""

LINE_BYTES_READ = 4 * MAX_RECORD_CHARS
"""The most bytes a line of MAX_RECORD_CHARS characters takes in UTF-8: a reader that meets no
line break in this many holds a line too long to import, and reads no further."""

_READ_CHUNK_BYTES = 2**16


def read_lines(stream: BinaryIO) -> Iterator[str]:
    """An export file's lines, read a chunk at a time: a file is never held whole as bytes, and
    one without line breaks (/dev/zero) is refused after LINE_BYTES_READ bytes. A byte that is
    not UTF-8, or a line over MAX_RECORD_CHARS characters, is an ImportFormatError naming its
    line (and the byte's offset in the file)."""
    # A buffered stream's read(n) waits for n bytes; read1 takes what one read of a pipe gives.
    read = getattr(stream, "read1", stream.read)
    pending = b""
    pending_offset = 0  # where `pending` starts in the file
    line_number = 1
    while True:
        chunk = read(_READ_CHUNK_BYTES)
        pending += chunk
        start = 0
        for line_break in _LINE_BREAK.finditer(pending):
            if chunk and line_break[0] == b"\r" and line_break.end() == len(pending):
                break  # a \n starting the next chunk belongs to this line break
            yield _decoded_line(pending[start:line_break.start()], line_number, pending_offset + start)
            line_number += 1
            start = line_break.end()
        pending, pending_offset = pending[start:], pending_offset + start
        if not chunk:
            yield _decoded_line(pending, line_number, pending_offset)
            return
        if len(pending) > LINE_BYTES_READ:
            raise ImportFormatError(line_number, f"no line break in its first {LINE_BYTES_READ} bytes: an export line "
                                                 f"is under 3 KB (at most {MAX_RECORD_CHARS} characters are read)")


def _decoded_line(data: bytes, line_number: int, offset: int) -> str:
    """Line `line_number` (its bytes start at `offset` in the file) as text, checked for length."""
    try:
        line = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ImportFormatError(
            line_number, f"not UTF-8 text at byte {offset + error.start} of the file (counted from 0): {error.reason}"
        ) from None
    if len(line) > MAX_RECORD_CHARS:
        raise ImportFormatError(line_number, _too_long(len(line)))
    return line


def _too_long(characters: int) -> str:
    return f"line of {characters} characters: an export line is under 3 KB (at most {MAX_RECORD_CHARS} are read)"


def decoded_lines(data: bytes) -> list[str]:
    """An export file's lines, from its bytes (a request body the service holds whole anyway)."""
    return list(read_lines(io.BytesIO(data)))


BYTE_ORDER_MARK = "\ufeff"
"""What some editors (Windows') put first in a UTF-8 file: no part of its JSON."""


def _parse_export(lines: Iterable[str]) -> list[ImportLine]:
    """Validate a whole export file before anything is written."""
    numbered = [
        (number, line.removeprefix(BYTE_ORDER_MARK) if number == 1 else line)
        for number, line in enumerate(lines, start=1)
        if line.strip()
    ]
    if not numbered:
        raise ImportFormatError(1, "empty file: expected a header line")
    for number, line in numbered:
        if len(line) > MAX_RECORD_CHARS:
            raise ImportFormatError(number, _too_long(len(line)))
    header_number, header_line = numbered[0]
    try:
        header = validate_json(ExportHeader, header_line)
    except (ValidationError, RepeatedKeyError) as error:
        raise ImportFormatError(header_number, f"bad header: {_validation_message(error)}") from None
    entries: list[ImportLine] = []
    for number, line in numbered[1:]:
        try:
            entries.append((number, validate_json(ExportLine, line)))
        except (ValidationError, RepeatedKeyError) as error:
            raise ImportFormatError(number, _validation_message(error)) from None
    if len(entries) != header.entries:
        raise ImportFormatError(header_number, f"header announces {header.entries} entries, file has {len(entries)}")
    return entries


def _check_file_consistency(entries: list[ImportLine]) -> None:
    """Within the file: one set of properties per GPU name, one measurement per uid."""
    gpus: dict[str, tuple[int, GpuSpec]] = {}
    uids: dict[str, tuple[int, dict[str, Any]]] = {}
    for number, line in entries:
        first_number, gpu = gpus.setdefault(line.gpu.name, (number, line.gpu))
        if (gpu.compute_capability, gpu.sm_count) != (line.gpu.compute_capability, line.gpu.sm_count):
            raise ImportFormatError(number, f"GPU {gpu.name!r} has other properties on line {first_number}")
        content = line.model_dump(exclude={"created_at"})
        first_number, first_content = uids.setdefault(line.measurement_uid, (number, content))
        if content != first_content:
            raise ImportFormatError(
                number, f"measurement uid {line.measurement_uid} is on line {first_number} with other content"
            )


def _check_against_store(session: Session, entries: list[ImportLine]) -> None:
    """Refuse the file before writing if a GPU or a uid it names is stored differently."""
    names = sorted({line.gpu.name for _, line in entries})
    stored_gpus = {
        gpu.name: gpu for chunk in _chunks(names) for gpu in session.scalars(select(Gpu).where(Gpu.name.in_(chunk)))
    }
    uids = [line.measurement_uid for _, line in entries]
    stored: dict[str, tuple[Measurement, str]] = {}
    for chunk in _chunks(uids):
        rows = session.execute(
            select(Measurement, Gpu.name).join(Gpu, Measurement.gpu_id == Gpu.id).where(Measurement.uid.in_(chunk))
        )
        stored |= {measurement.uid: (measurement, gpu_name) for measurement, gpu_name in rows}
    for number, line in entries:
        try:
            if line.gpu.name in stored_gpus:
                _check_gpu(stored_gpus[line.gpu.name], line.gpu)
            if line.measurement_uid in stored:
                measurement, gpu_name = stored[line.measurement_uid]
                _check_same_content(measurement, line, same_gpu=gpu_name == line.gpu.name)
        except ConflictError as error:
            raise ImportFormatError(number, str(error)) from None


def _chunks(values: list[str]) -> Iterator[list[str]]:
    """`values` in lists of IN_QUERY_CHUNK, one IN (...) each."""
    for start in range(0, len(values), IN_QUERY_CHUNK):
        yield values[start : start + IN_QUERY_CHUNK]


def _key_of(line: ExportLine) -> tuple[Any, ...]:
    """The best entry a line competes for (BEST_KEY_COLUMNS, with the GPU by name)."""
    return (
        line.gpu.name, line.kernel, line.kernel_version, line.triton_version,
        line.V, line.D, line.dtype, n_bucket(line.tokens), line.mode,
    )  # fmt: skip


def _batches(entries: list[ImportLine]) -> Iterator[list[ImportLine]]:
    """The lines in batches of about IMPORT_BATCH_LINES, each key's lines together and in
    file order: no batch sees another's effects, so a dry run's rolled-back batches report
    what the import does."""
    by_key: dict[tuple[Any, ...], list[ImportLine]] = {}
    for number, line in entries:
        by_key.setdefault(_key_of(line), []).append((number, line))
    batch: list[ImportLine] = []
    for group in by_key.values():
        if batch and len(batch) + len(group) > IMPORT_BATCH_LINES:
            yield batch
            batch = []
        batch.extend(group)
    if batch:
        yield batch


def _write_lines(
    engine: Engine, entries: list[ImportLine], mode: ImportMode, dry_run: bool, counts: Counter[str],
    advance: Callable[[], None],
) -> None:
    """Write `entries` in one transaction (rolled back for a dry run), adding to `counts`, and
    `advance()` after each row (a line's measurement, then its best entry).

    The rows are written, so locked, in the order every writer follows: GPUs by name, then
    measurements by uid, then best entries by key (a key's lines in file order);
    record_measurement takes one of each. Two writers therefore never wait for each other in
    a circle: on PostgreSQL they queue for the rows instead of deadlocking."""
    with write_session(engine) as session:
        gpus = {line.gpu.name: (number, line.gpu) for number, line in reversed(entries)}  # each one's first line
        gpu_ids = {name: _on_line(number, _gpu_id, session, spec) for name, (number, spec) in sorted(gpus.items())}
        rows: dict[int, Measurement] = {}
        for number, line in sorted(entries, key=lambda entry: entry[1].measurement_uid):
            rows[number], added = _on_line(
                number, _add_measurement, session, line, gpu_ids[line.gpu.name], line.measurement_uid, line.created_at
            )
            counts["measurements_added"] += added
            advance()
        # A line whose measurement was retired leaves its key alone, in every mode: whether its
        # entry is still retired or another measurement has replaced it since. The key's entry
        # is locked before retired_measurements is read: a retire holds the entry until it
        # commits, and each PostgreSQL statement sees what committed before it began, so a
        # retire that committed while this import ran is seen.
        for number, line in sorted(entries, key=lambda entry: _key_of(entry[1])):
            row = rows[number]
            entry = session.execute(select(BestConfig.id).where(*_same_key(row)).with_for_update()).first()
            retired = session.execute(
                select(RetiredMeasurement.measurement_id).where(RetiredMeasurement.measurement_id == row.id)
            ).first()
            existed = entry is not None
            applied = retired is None and _upsert_best(session, row, mode)
            counts["entries_replaced" if existed and applied else "entries_kept" if existed else "entries_added"] += 1
            advance()
        if dry_run:
            session.rollback()


def _on_line(number: int, write: Callable[..., T], *args: Any) -> T:
    """`write(*args)`, its ConflictError an ImportFormatError naming line `number`."""
    try:
        return write(*args)
    except ConflictError as error:
        raise ImportFormatError(number, str(error)) from None


def import_jsonl(
    engine: Engine, lines: Iterable[str], mode: ImportMode = "keep_better", dry_run: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> ImportReport:
    """Import an export file.

    The whole file is validated, and checked against the store (GPUs, uids), before anything
    is written. On PostgreSQL it is then written in one transaction: all lines or none. On
    SQLite it is written in batches, one transaction each, so that other writers are not
    locked out of the database for the whole file; should a batch still fail there (a
    concurrent writer registered a GPU or uid differently in between, or a Ctrl-C:
    ImportStopped), the batches before it stay: importing the file again is safe, it adds
    nothing twice.

    Every line's measurement joins the history once (by its uid, which names one content);
    `mode` decides the key's best entry: keep_better keeps the faster, skip keeps any
    existing entry, overwrite takes the file's. `dry_run` does all of it and rolls back
    (each batch), to report what would change. `progress(rows_written, rows)` follows the
    writes: two rows a line, its measurement and its best entry.
    """
    entries = _parse_export(lines)
    _check_file_consistency(entries)
    with read_session(engine, snapshot=True) as session:
        _check_against_store(session, entries)
    counts: Counter[str] = Counter()

    def advance() -> None:
        counts["rows_written"] += 1
        if progress is not None:
            progress(counts["rows_written"], 2 * len(entries))

    if engine.dialect.name != "sqlite":
        _write_lines(engine, entries, mode, dry_run, counts, advance)
    else:
        written = 0
        for index, batch in enumerate(_batches(entries)):
            try:
                if index:
                    time.sleep(SQLITE_BATCH_PAUSE_S)
                _write_lines(engine, batch, mode, dry_run, counts, advance)
            # DBAPIError: a lock held past the busy timeout; KeyboardInterrupt: Ctrl-C
            except (ImportFormatError, DBAPIError, KeyboardInterrupt) as error:
                if not written or dry_run:
                    raise
                if isinstance(error, KeyboardInterrupt):  # a batch stopped mid-way rolled back
                    raise ImportStopped(written, len(entries)) from None
                if isinstance(error, DBAPIError):
                    raise ImportInterrupted(written, len(entries), error) from error
                raise ImportFormatError(
                    error.line_number,
                    f"{error.reason}; the {written} lines before its batch were imported (SQLite takes a file "
                    "in batches): import the file again once this is mended, it adds nothing twice",
                    lines_imported=written,
                ) from None
            written += len(batch)
    return ImportReport(
        lines=len(entries),
        measurements_added=counts["measurements_added"],
        entries_added=counts["entries_added"],
        entries_replaced=counts["entries_replaced"],
        entries_kept=counts["entries_kept"],
        dry_run=dry_run,
    )
