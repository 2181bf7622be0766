"""HTTP request and response shapes beyond the store's own records (tuning_db.records,
whose MeasurementIn is the POST body as it is). Unknown fields are rejected."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tuning_db.records import MAX_ROW_ID, BestEntry, ConfigFilters, ImportMode, MatchLevel


class Forbidding(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NoQuery(Forbidding):
    """The query of a route that takes none: any parameter is refused (422), as on the routes
    that take some, so a misspelt or unsupported one is never silently ignored."""


class BestConfigResponse(Forbidding):
    """What a launching node needs: the config, how well it matches, and where it came from.
    With match_level 'none' the node uses its own defaults."""

    match_level: MatchLevel
    config: dict[str, Any] | None
    speedup: float | None = Field(description="default_ms / median_ms of the source measurement")
    entry_id: int | None
    n_bucket: int = Field(description="the bucket of the requested token count")
    source: BestEntry | None


class ConfigListQuery(ConfigFilters):
    limit: int = Field(100, ge=1, le=1000)
    offset: int = Field(0, ge=0, le=MAX_ROW_ID)


class ConfigPage(Forbidding):
    items: list[BestEntry]
    total: int
    limit: int
    offset: int


class ImportQuery(Forbidding):
    mode: ImportMode = "keep_better"
    dry_run: bool = False


class Health(Forbidding):
    status: str
    detail: str | None = None
