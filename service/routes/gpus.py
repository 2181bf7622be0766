"""The GPUs the store knows."""

from __future__ import annotations

from fastapi import APIRouter

from service.deps import READ, EngineDep
from tuning_db import store
from tuning_db.records import GpuSummary

router = APIRouter(prefix="/v1", tags=["gpus"])


@router.get("/gpus", dependencies=READ, response_model=list[GpuSummary])
def list_gpus(engine: EngineDep) -> list[GpuSummary]:
    return store.list_gpus(engine)
