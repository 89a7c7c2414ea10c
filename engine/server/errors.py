"""OpenAI-style error bodies ``{"error": {"message", "type", "param", "code"}}`` for every failure.

Every error a client can cause maps to a 4xx with that body; a 500 means a server bug and is
reported with the same body (never an HTML page or a bare string).
"""

from __future__ import annotations

import logging
import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvpilot.engine.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

# Error types as the openai client names its exceptions (openai.BadRequestError, ...).
_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.UNAUTHORIZED: "AuthenticationError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.METHOD_NOT_ALLOWED: "MethodNotAllowedError",
    HTTPStatus.UNPROCESSABLE_ENTITY: "BadRequestError",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
}

# ValueErrors from SamplingParams / the engine start with the parameter they concern.
_PARAM_PREFIX = re.compile(r"^([a-z_]+)[: ]")


class OpenAIError(Exception):
    """A failure to report to the client with an HTTP status and OpenAI's error body.

    Args:
        status: the HTTP status.
        message: what was wrong, for a human.
        param: the request parameter at fault, if one is.
        headers: extra response headers (``Retry-After`` on 503).
    """

    def __init__(
        self,
        status: HTTPStatus,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}


def bad_request(exc: ValueError | str, param: str | None = None) -> OpenAIError:
    """A 400 from a ``ValueError`` whose message starts with the parameter name (if any)."""
    message = str(exc)
    if param is None:
        match = _PARAM_PREFIX.match(message)
        param = match.group(1) if match else None
    return OpenAIError(HTTPStatus.BAD_REQUEST, message, param)


def error_response(
    status: HTTPStatus,
    message: str,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """The JSON response for one error."""
    body = ErrorResponse(
        error=ErrorInfo(
            message=message,
            type=_ERROR_TYPES.get(status, "APIError"),
            param=param,
            code=int(status),
        )
    )
    return JSONResponse(body.model_dump(), status_code=int(status), headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Make every error path of ``app`` answer with OpenAI's error body."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # OpenAI answers 400 for invalid parameters, not FastAPI's default 422.
        if isinstance(exc.body, bytes):
            # FastAPI parses a body as JSON only under a JSON content type (no sniffing, as a
            # guard against cross-site requests); it hands the other bodies over unparsed.
            content_type = request.headers.get("content-type")
            got = f"Content-Type: {content_type}" if content_type else "no Content-Type"
            return error_response(
                HTTPStatus.BAD_REQUEST,
                "the request body must be JSON sent with 'Content-Type: application/json' "
                f"(got {got})",
            )
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            # loc is ("body", <character position>): not a parameter.
            position = first.get("loc", (None, None))[-1]
            reason = first.get("ctx", {}).get("error", "JSON decode error")
            return error_response(
                HTTPStatus.BAD_REQUEST,
                f"the request body is not valid JSON: {reason} at character {position}",
            )
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        if not loc and first.get("type") == "missing":
            return error_response(
                HTTPStatus.BAD_REQUEST, "the request body is missing: send a JSON object"
            )
        param = loc[0] if loc else None
        message = first.get("msg", "invalid request")
        if message.startswith("Value error, "):
            message = message.removeprefix("Value error, ")
            param = _PARAM_PREFIX.match(message).group(1) if _PARAM_PREFIX.match(message) else param
        where = ".".join(loc)
        text = f"{where}: {message}" if where and not message.startswith(f"{param}:") else message
        return error_response(HTTPStatus.BAD_REQUEST, text, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = HTTPStatus(exc.status_code)
        return error_response(status, str(exc.detail), None, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error while serving a request")
        return error_response(
            HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {type(exc).__name__}: {exc}"
        )
