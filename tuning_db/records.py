"""What goes into and comes out of the tuning database, as validated data.

The service's request bodies and the import lines are these models, so a value is checked
the same way whether it arrives over HTTP or in an export file. The store's answers are
models too, but of plain types: what is stored is served as it is, never re-validated.
Every incoming config goes through `KernelConfig.from_dict` and is kept in its canonical
`to_dict()` form. Names are restricted to a small alphabet: they are keys, never text.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

from cce_compile.config.kernel_config import KernelConfig
from cce_compile.config.keys import MATCH_LEVELS, MatchLevel, normalize_gpu_name  # noqa: F401 (re-exported)

NEAREST_BUCKET_FACTOR = 4
"""A config tuned for another token bucket is used only within this factor (never snap far)."""

Dtype = Literal["float32", "float16", "bfloat16"]
Mode = Literal["exact", "filtered"]
ImportMode = Literal["keep_better", "skip", "overwrite"]


Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.+\-]{1,128}$")]


def _named(key: str) -> str:
    """Refuse a name without a letter or digit ('___', '...', '(-)'): it would be a key of no GPU."""
    if not any(character.isalnum() for character in key):
        raise ValueError("the GPU name must contain a letter or digit")
    return key


GpuName = Annotated[
    str,
    StringConstraints(pattern=r"^[A-Za-z0-9 _.()\-]{1,128}$"),
    AfterValidator(normalize_gpu_name),
    AfterValidator(_named),
]
ComputeCapability = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,2}\.[0-9]{1,2}$")]
SmCount = Annotated[int, Field(ge=1, le=4096)]
VocabSize = Annotated[int, Field(ge=1, le=2**31 - 1)]
HiddenSize = Annotated[int, Field(ge=1, le=2**20)]
Tokens = Annotated[int, Field(ge=1, le=2**40)]
MIN_MILLISECONDS = 1e-3
MAX_MILLISECONDS = 1e6
Milliseconds = Annotated[float, Field(ge=MIN_MILLISECONDS, le=MAX_MILLISECONDS, allow_inf_nan=False)]
"""A kernel time: 1 us (no launch is faster; 5e-324 would make speedup overflow) to 1000 s."""
MAX_ROW_ID = 2**31 - 1
"""Row ids are 32-bit INTEGER columns on PostgreSQL: a larger one names no row."""
RowId = Annotated[int, Field(ge=1, le=MAX_ROW_ID)]
EARLIEST_STORED = datetime.min.replace(tzinfo=timezone.utc) + timedelta(days=1)
LATEST_STORED = datetime.max.replace(tzinfo=timezone.utc) - timedelta(days=1)
"""The moments a database holds: years 1..9999 in UTC (PostgreSQL refuses others, Python
reads no others back), less a day, so that a session in any time zone can read them."""


def as_utc(moment: datetime) -> datetime:
    """`moment` in UTC, a time without an offset taken as UTC: what SQLite hands back (naive
    UTC) and PostgreSQL (aware, in the session's zone) alike."""
    return moment.replace(tzinfo=timezone.utc) if moment.tzinfo is None else moment.astimezone(timezone.utc)


def _stored_moment(moment: datetime) -> datetime:
    """`moment` in UTC (a time without an offset is UTC), within what the databases store.
    Converting here, not in the store, keeps both databases alike: SQLite's DateTime drops
    the offset of what it is given, PostgreSQL converts it."""
    refused = ValueError(
        f"must lie between {EARLIEST_STORED.isoformat()} and {LATEST_STORED.isoformat()} once converted to UTC"
    )
    try:
        utc = as_utc(moment)
    except OverflowError:  # before year 1 or after 9999, in UTC
        raise refused from None
    if not EARLIEST_STORED <= utc <= LATEST_STORED:
        raise refused
    return utc


StoredMoment = Annotated[datetime, AfterValidator(_stored_moment)]


CLIPPED_CHARS = 200
"""How much of one piece of input an error message may quote."""


IDEMPOTENCY_KEY_HEADER = "Idempotency-Key"
"""Names a measurement across its sends (a UUID, stored as its uid): the service stores it once
however often it comes; a service older than the header ignores it."""

MAX_RECORD_CHARS = 64 * 2**10
"""The longest measurement or export line read: one is under 3 KB even indented, and parsing a
longer one, then listing its errors, holds the GIL (and every other request) for seconds."""


MAX_REPORTED_ERRORS = 20
"""An error names this many bad fields at most (a body or line of 50,000 unknown keys has as many)."""


def clip(text: str, limit: int = CLIPPED_CHARS) -> str:
    """`text` cut to `limit` characters, saying how long it was: errors name bad input
    without handing megabytes of it back."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def canonical_config(config: Any) -> dict[str, Any]:
    """`config` in the form it is stored in (`KernelConfig.to_dict()`, every field present);
    ConfigError (a ValueError) naming the key if today's rules refuse it."""
    return KernelConfig.from_dict(config).to_dict()


class StrictModel(BaseModel):
    """Untrusted JSON: no coercion ("64" is not 64), no unknown keys."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class RepeatedKeyError(ValueError):
    """A JSON object that gives a key twice, which JSON parsers (pydantic's too) read silently,
    the last value winning."""


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """`json.loads`' object_pairs_hook that refuses a repeated key (RepeatedKeyError)."""
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise RepeatedKeyError(f"the key {clip(key)!r} is given twice in one object")
        seen.add(key)
    return dict(pairs)


Model = TypeVar("Model", bound=BaseModel)


def validate_json(model: type[Model], text: str) -> Model:
    """`model.model_validate_json(text)`, refusing a key given twice (RepeatedKeyError)."""
    try:
        json.loads(text, object_pairs_hook=unique_keys)
    except RepeatedKeyError:
        raise
    except (ValueError, RecursionError):  # not JSON, nested too deep, an integer past Python's digits limit:
        pass  # pydantic names what is wrong
    return model.model_validate_json(text)


class GpuSpec(StrictModel):
    name: GpuName
    compute_capability: ComputeCapability
    sm_count: SmCount
    memory_bytes: int = Field(ge=0, le=2**50)


class MeasurementIn(StrictModel):
    """One timed run of one config, as a tuner submits it."""

    gpu: GpuSpec
    kernel: Name
    kernel_version: Name = Field(description="hash of the kernel source, from the client")
    triton_version: Name
    torch_version: Name
    V: VocabSize
    D: HiddenSize
    dtype: Dtype
    tokens: Tokens = Field(description="N, the token count that was timed")
    mode: Mode
    config: dict[str, Any]
    median_ms: Milliseconds
    p20_ms: Milliseconds
    p80_ms: Milliseconds
    default_ms: Milliseconds = Field(description="the default config's time in the same run")
    method: Name = Field(description="how it was timed, e.g. triton.do_bench")
    submitter: Name
    host: Name

    @field_validator("config")
    @classmethod
    def _canonical_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        return canonical_config(config)

    @model_validator(mode="after")
    def _ordered_quantiles(self) -> MeasurementIn:
        if not self.p20_ms <= self.median_ms <= self.p80_ms:
            raise ValueError("times must satisfy p20_ms <= median_ms <= p80_ms")
        return self


class ExportLine(MeasurementIn):
    """One best entry in an export file: its measurement, with the identity it had."""

    measurement_uid: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]
    created_at: StoredMoment


def _integer(value: Any) -> Any:
    """Refuse what merely compares equal to an integer literal (true, 1.0): Literal[1] takes
    them, strict or not."""
    if type(value) is not int:
        raise ValueError(f"expected an integer, got {type(value).__name__}")
    return value


class ExportHeader(StrictModel):
    """First line of an export; an importer rejects any other format or schema version."""

    format: Literal["cce-tuning-db"] = "cce-tuning-db"
    schema_version: Annotated[Literal[1], BeforeValidator(_integer)] = 1
    entries: int = Field(ge=0)
    measurements: int = Field(ge=0, description="the measurements the file carries, one per entry")


class LookupQuery(BaseModel):
    """A launch's question: the best config for this GPU and problem (query strings, so lax)."""

    model_config = ConfigDict(extra="forbid")

    gpu: GpuName
    kernel: Name
    kernel_version: Name
    triton_version: Name
    V: VocabSize
    D: HiddenSize
    dtype: Dtype
    tokens: Tokens
    mode: Mode
    compute_capability: ComputeCapability | None = Field(
        None, description="with sm_count, allows a same_arch answer for a GPU the store has not seen"
    )
    sm_count: SmCount | None = None

    @model_validator(mode="after")
    def _arch_given_together(self) -> LookupQuery:
        if (self.compute_capability is None) != (self.sm_count is None):
            raise ValueError("compute_capability and sm_count go together")
        return self


class StoredGpu(BaseModel):
    """A GPU as stored. Answers are not re-validated against the input rules: a row written
    before a rule existed must still be served (and can be retired), never fail the endpoint."""

    name: str
    compute_capability: str
    sm_count: int
    memory_bytes: int


class BestEntry(BaseModel):
    """A best config with the measurement it came from (as stored, see StoredGpu)."""

    entry_id: int
    gpu: StoredGpu
    kernel: str
    kernel_version: str
    triton_version: str
    torch_version: str
    V: int
    D: int
    dtype: str
    n_bucket: int
    mode: str
    config: dict[str, Any]
    median_ms: float
    p20_ms: float
    p80_ms: float
    default_ms: float
    speedup: float | None = Field(
        description="default_ms / median_ms; null where that is not finite (a time the first release took, "
        "such as 5e-324 ms)"
    )
    tokens: int
    method: str
    submitter: str
    host: str
    measurement_uid: str
    measured_at: datetime
    updated_at: datetime
    retired: bool


class LookupResult(BaseModel):
    match_level: MatchLevel
    n_bucket: int = Field(description="the bucket of the requested token count")
    entry: BestEntry | None


class RecordResult(BaseModel):
    measurement_uid: str
    entry_id: int
    is_best: bool = Field(description="whether this measurement is now the key's best")
    best_median_ms: float
    already_stored: bool = Field(
        False, description="whether an earlier send under the same Idempotency-Key stored it: nothing was added"
    )


class GpuSummary(BaseModel):
    name: str
    compute_capability: str
    sm_count: int
    memory_bytes: int
    entries: int = Field(description="live best configs for this GPU")


class ConfigFilters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    gpu: GpuName | None = None
    kernel: Name | None = None
    kernel_version: Name | None = None
    triton_version: Name | None = None
    V: VocabSize | None = None
    D: HiddenSize | None = None
    dtype: Dtype | None = None
    mode: Mode | None = None
    include_retired: bool = False


class ImportReport(BaseModel):
    lines: int
    measurements_added: int = Field(description="measurements not already present (by uid)")
    entries_added: int = Field(description="keys that had no best entry")
    entries_replaced: int
    entries_kept: int = Field(description="keys whose existing entry stayed (better, or mode=skip)")
    dry_run: bool
