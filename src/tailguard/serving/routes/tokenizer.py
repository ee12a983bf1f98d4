"""``/admin/tokenizer/glossary`` (admin key only): the domain glossary kept pre-tokenized in the tokenize cache.

``GET`` shows the glossary (its file, terms, when it was loaded, the last failure), the cache's hits and the
batcher's counters; ``POST`` loads the file again now, without waiting for the poll to see it change.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tailguard.api_error import APIError
from tailguard.serving.state import state_of
from tailguard.serving.tokenize_pipeline import GlossaryUnavailable, pipeline_of


async def glossary(request: Request) -> Response:
    state = state_of(request)
    state.keys.admin(request.headers.get("authorization"))
    return JSONResponse(pipeline_of(state).describe())


async def reload_glossary(request: Request) -> Response:
    state = state_of(request)
    state.keys.admin(request.headers.get("authorization"))
    pipeline = pipeline_of(state)
    if state.engine is None:
        raise APIError(503, "the model is still loading; try again when /ready says so", code="not_ready")
    try:
        await pipeline.reload_glossary(force=True)
    except GlossaryUnavailable as exc:
        raise APIError(404, str(exc), code="glossary_unavailable") from None
    except (OSError, ValueError) as exc:
        raise APIError(409, f"the glossary file could not be loaded (the terms before stay): "
                            f"{pipeline.glossary.error if pipeline.glossary else exc}",
                       code="glossary_unreadable") from None
    return JSONResponse(pipeline.describe())
