"""The GPUs the store knows."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from service.deps import READ, EngineDep
from service.schemas import AUTH, DATABASE, NoQuery, errors
from tuning_db import store
from tuning_db.records import GpuSummary

router = APIRouter(prefix="/v1", tags=["gpus"], responses=errors(*AUTH, *DATABASE))


@router.get("/gpus", dependencies=READ, response_model=list[GpuSummary])
def list_gpus(_query: Annotated[NoQuery, Query()], engine: EngineDep) -> list[GpuSummary]:
    return store.list_gpus(engine)
