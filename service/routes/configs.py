"""Looking up, listing and retiring best configs."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Path, Query
from pydantic import BeforeValidator

from service.deps import ADMIN, READ, EngineDep, MetricsDep
from service.schemas import AUTH, DATABASE, BestConfigResponse, ConfigListQuery, ConfigPage, NoQuery, errors
from tuning_db import store
from tuning_db.records import BestEntry, LookupQuery, RowId

router = APIRouter(prefix="/v1/configs", tags=["configs"], responses=errors(*AUTH, *DATABASE))


@router.get("/best", dependencies=READ, response_model=BestConfigResponse)
def best_config(query: Annotated[LookupQuery, Query()], engine: EngineDep, metrics: MetricsDep) -> BestConfigResponse:
    """The best known config for a GPU and problem, never from a bucket more than 4x away."""
    result = store.lookup(engine, query)
    metrics.count_lookup(result.match_level)
    entry = result.entry
    return BestConfigResponse(
        match_level=result.match_level,
        config=entry.config if entry else None,
        speedup=entry.speedup if entry else None,
        entry_id=entry.entry_id if entry else None,
        n_bucket=result.n_bucket,
        source=entry,
    )


@router.get("", dependencies=READ, response_model=ConfigPage)
def list_configs(query: Annotated[ConfigListQuery, Query()], engine: EngineDep) -> ConfigPage:
    items, total = store.list_configs(engine, query, limit=query.limit, offset=query.offset)
    return ConfigPage(items=items, total=total, limit=query.limit, offset=query.offset)


def _written_in_digits(value: object) -> object:
    """An id as the service writes it: '1.0', '+5' and '0010' once named entries 1, 5 and 10."""
    if isinstance(value, str) and not re.fullmatch(r"[1-9][0-9]*", value):
        raise ValueError("an entry id is a positive integer in digits, without sign, point or leading zeros")
    return value


@router.post("/{entry_id}/retire", dependencies=ADMIN, response_model=BestEntry, responses=errors(404))
def retire_config(
    entry_id: Annotated[RowId, BeforeValidator(_written_in_digits), Path()], _query: Annotated[NoQuery, Query()],
    engine: EngineDep,
) -> BestEntry:
    """Flag a bad entry: lookups skip it until the key's next measurement replaces it."""
    return store.retire(engine, entry_id)
