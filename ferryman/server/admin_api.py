"""Admin endpoints: the split of the device region between KV pages and expert slots, and its live
bounds (`ferryman ctl` speaks these). Behind the API key like every /v1 route.

    GET  /v1/admin/memory   the split (engine/memory_split.py), hit rate, link GB/s, preemptions
    POST /v1/admin/memory   {"min_expert_slots", "max_expert_slots", "kv_reserve_tokens"} (each optional)

Both run on the engine thread between two steps, through the engine's public API.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from ferryman.engine.llm_engine import LLMEngine
from ferryman.errors import EngineDeadError, FerrymanError
from ferryman.server.errors import APIError
from ferryman.server.state import ServerState

router = APIRouter()
# an admin call waits at most this long for the engine thread (one step, normally)
ADMIN_TIMEOUT_S = 60.0


class MemoryBounds(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_expert_slots: int | None = Field(None, ge=1)
    max_expert_slots: int | None = Field(None, ge=1)
    kv_reserve_tokens: int | None = Field(None, ge=0)


async def _on_engine(request: Request, fn: Callable[[LLMEngine], dict]) -> dict[str, Any]:
    state: ServerState = request.app.state.ferryman
    try:
        return await asyncio.wait_for(state.loop.call(fn), ADMIN_TIMEOUT_S)
    except EngineDeadError as e:
        raise APIError(503, str(e)) from None
    except TimeoutError:
        raise APIError(503, f"the engine thread did not answer within {ADMIN_TIMEOUT_S:.0f} s") from None
    except (ValueError, FerrymanError) as e:
        raise APIError(400, str(e), _field_of(str(e))) from None


def _field_of(message: str) -> str | None:
    return next((f for f in MemoryBounds.model_fields if message.startswith(f)), None)


@router.get("/v1/admin/memory")
async def memory(request: Request) -> dict[str, Any]:
    return await _on_engine(request, lambda engine: engine.memory_split())


@router.post("/v1/admin/memory")
async def set_memory(body: MemoryBounds, request: Request) -> dict[str, Any]:
    bounds = body.model_dump()
    return await _on_engine(request, lambda engine: engine.set_memory_bounds(**bounds))
