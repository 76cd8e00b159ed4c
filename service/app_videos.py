"""The video job routes: ``POST /v1/videos`` (JSON, or OpenAI's multipart form), ``GET /v1/videos`` (a page
of jobs), ``GET /v1/videos/{id}``, ``GET /v1/videos/{id}/content`` and ``DELETE /v1/videos/{id}``.

The statuses are OpenAI's (queued, in_progress, completed, failed; plus cancelled), so OpenAI's client
(``client.videos.create_and_poll``, ``download_content``, ``list``, ``delete``) drives the service as it is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from stepwatch.service import api
from stepwatch.service.forms import parse_form
from stepwatch.service.http import (
    ERRORS,
    AsciiJSON,
    ClientGone,
    error_response,
    in_thread,
    internal_error,
    read_body,
    service_of,
)

log = logging.getLogger("stepwatch.service")
router = APIRouter()
POLL_AFTER_MS = 500  # OpenAI's client waits this long between polls when the answer says so


class VideosRequest(BaseModel):
    """``POST /v1/videos``: a job is queued and answered at once (202) with its id."""

    prompt: str = Field(min_length=1, max_length=api.MAX_PROMPT_CHARS)
    size: str | None = Field(None, description="one of the service's video sizes (GET /v1/stepwatch/info)")
    frames: int | None = Field(None, description="4k+1 frames (5, 9, ..., up to video.max_frames)")
    seconds: str | None = Field(None, description="OpenAI's duration instead of frames: the nearest 4k+1 frames")
    model: str | None = Field(None, description="accepted and not used: the service serves one video model")
    steps: int | None = Field(None, ge=1)
    guidance_scale: float | None = Field(None, ge=0.0, le=30.0, description="> 1 runs CFG (default: none)")
    seed: int | None = Field(None, ge=0, le=2**32 - 1)


VIDEOS_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": VideosRequest.model_json_schema()},
    "multipart/form-data": {"schema": VideosRequest.model_json_schema()}}}}
VIDEO_POOL = "video"


@router.post("/v1/videos", status_code=202, responses=ERRORS, openapi_extra=VIDEOS_BODY)
async def create_video(request: Request) -> Response:
    """Queue a video job; the answer (202, at once) is the job with its id: poll GET /v1/videos/{id}."""
    svc = service_of(request)
    t0 = time.monotonic()
    try:
        raw = await read_body(request)
        content_type = request.headers.get("content-type", "")
        body = parse_form(raw, content_type) if content_type.startswith("multipart/form-data") else api.parse_json(raw)
        job = await in_thread(request, svc.submit_video, body)
        response: Response = AsciiJSON(job, 202, {"Location": f"/v1/videos/{job['id']}"})
        status = 202
    except ClientGone:
        status, response = 499, Response(status_code=499)
    except api.ApiError as e:
        status, response = e.status, error_response(e)
    except Exception as e:  # never take the instance down for one request
        log.exception("unexpected error creating a video job")
        status, response = 500, error_response(internal_error(e))
    svc.count(VIDEO_POOL, status, t0)
    return response


async def _video_call(request: Request, fn: Callable[..., Any], *args: Any) -> Response:
    try:
        out = await in_thread(request, fn, *args)
    except api.ApiError as e:
        return error_response(e)
    except Exception as e:
        log.exception("video job request failed")
        return error_response(internal_error(e))
    if isinstance(out, tuple):
        content, media = out
        return Response(content, media_type=media, headers={"Content-Disposition": f'inline; filename="{args[0]}.mp4"'})
    in_flight = out.get("status") in ("queued", "in_progress")
    return AsciiJSON(out, headers={"openai-poll-after-ms": str(POLL_AFTER_MS)} if in_flight else None)


@router.get("/v1/videos", responses=ERRORS)
async def list_videos(request: Request, limit: str = "20", after: str | None = None, order: str = "desc") -> Response:
    """The jobs the service remembers, newest first by default: OpenAI's list (``data``, ``first_id``,
    ``last_id``, ``has_more``; page on with ``after`` = the last id).  The parameters are read here, not by
    FastAPI, so a bad one gets the API's error shape (a 400 naming it), not a 422."""
    if not (limit.isascii() and limit.isdigit() and 1 <= int(limit) <= 100):
        return error_response(api.ApiError(400, f"'limit' must be an integer from 1 to 100, got {limit[:20]!r}",
                                           "limit"))
    if order not in ("asc", "desc"):
        return error_response(api.ApiError(400, f"'order' must be 'asc' or 'desc', got {order[:20]!r}", "order"))
    return await _video_call(request, service_of(request).list_videos, int(limit), after, order)


@router.get("/v1/videos/{job_id}", responses=ERRORS)
async def get_video(request: Request, job_id: str) -> Response:
    """The job: status (queued, in_progress, completed, failed, cancelled), step k of n, errors, timings."""
    return await _video_call(request, service_of(request).video, job_id)


@router.get("/v1/videos/{job_id}/content", responses=ERRORS)
async def get_video_content(request: Request, job_id: str) -> Response:
    """The finished job's video (MP4, H.264); 409 while it has none."""
    return await _video_call(request, service_of(request).video_content, job_id)


@router.delete("/v1/videos/{job_id}", responses=ERRORS)
async def cancel_video(request: Request, job_id: str) -> Response:
    """Cancel a job in flight, answered at once: queued, it never runs; denoising, it stops after its current step
    (``cancel_requested`` until then); decoding, 409 ``not_cancellable``.  A finished job is deleted with its
    video (``{"object": "video.deleted"}``)."""
    return await _video_call(request, service_of(request).cancel_video, job_id)
