"""OpenAI-style error bodies ``{"error": {"message", "type", "param", "code"}}`` for every failure.

Every error a client can cause maps to a 4xx with that body; a 500 means a server bug and is
reported with the same body (never an HTML page or a bare string).
"""

from __future__ import annotations

import email.message
import json
import logging
import re
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
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

    def response(self) -> JSONResponse:
        """The JSON response that reports this error."""
        return error_response(self.status, self.message, self.param, self.headers)


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
    body = error_body(status, message, param)
    return JSONResponse(body.model_dump(), status_code=int(status), headers=headers)


def error_body(status: HTTPStatus, message: str, param: str | None = None) -> ErrorResponse:
    """OpenAI's error body for ``status``: its type as the openai client names it. A lone
    surrogate the message quotes from the request (``"\ud800"``, which UTF-8 cannot carry) is
    written as its escape."""
    return ErrorResponse(
        error=ErrorInfo(
            message=message.encode("utf-8", "backslashreplace").decode("utf-8"),
            type=_ERROR_TYPES.get(status, "APIError"),
            param=param,
            code=int(status),
        )
    )


def validation_error(exc: RequestValidationError, content_type: str | None) -> OpenAIError:
    """The 400 for a body FastAPI (or ``read_body``) could not read or validate.

    Args:
        exc: the validation failure; ``exc.body`` is bytes when the body was not parsed as JSON.
        content_type: the request's ``Content-Type`` header, if any.
    """
    if isinstance(exc.body, bytes):
        # FastAPI parses a body as JSON only under a JSON content type (no sniffing, as a
        # guard against cross-site requests); it hands the other bodies over unparsed.
        got = f"Content-Type: {content_type}" if content_type else "no Content-Type"
        return OpenAIError(
            HTTPStatus.BAD_REQUEST,
            f"the request body must be JSON sent with 'Content-Type: application/json' (got {got})",
        )
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":
        # loc is ("body", <character position>): not a parameter.
        position = first.get("loc", (None, None))[-1]
        reason = first.get("ctx", {}).get("error", "JSON decode error")
        # json's messages that end in "at" ("Unterminated string starting at") take the
        # position as their object: "... starting at character 9", not "... at at ...".
        reason = reason.removesuffix(" at")
        return OpenAIError(
            HTTPStatus.BAD_REQUEST,
            f"the request body is not valid JSON: {reason} at character {position}",
        )
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if not loc and first.get("type") == "missing":
        return OpenAIError(
            HTTPStatus.BAD_REQUEST, "the request body is missing: send a JSON object"
        )
    param = loc[0] if loc else None
    message = first.get("msg", "invalid request")
    if message.startswith("Value error, "):
        message = message.removeprefix("Value error, ")
        # A model validator's error has no location: its message names the parameter. A field
        # validator's is that field's, whatever word its message starts with.
        if not loc and (named := _PARAM_PREFIX.match(message)):
            param = named.group(1)
    where = ".".join(loc)
    text = f"{where}: {message}" if where and not message.startswith(f"{param}:") else message
    return OpenAIError(HTTPStatus.BAD_REQUEST, text, param)


def renamed(error: OpenAIError, names: dict[str, str], keep: tuple[str, ...] = ()) -> OpenAIError:
    """``error`` with the parameter names of ``names`` replaced (its ``param`` and whole words
    of its message): an error of a chat completion made from another API's request, named by
    that API's fields. Errors about the parameters in ``keep`` stay as they are (their text
    quotes the request's own names, e.g. of its tools)."""
    if error.param in keep:
        return error
    words = re.compile(rf"\b({'|'.join(map(re.escape, names))})\b")
    error.param = names.get(error.param, error.param)
    error.message = words.sub(lambda match: names[match.group(1)], error.message)
    return error


def request_error(exc: ValueError) -> OpenAIError:
    """The 400 for a request derived from the client's (a chat completion made of a Responses
    or Messages body) that could not be read: a pydantic ``ValidationError`` as
    ``validation_error`` words it, another ``ValueError`` as ``bad_request``."""
    if isinstance(exc, ValidationError):
        errors = exc.errors(include_url=False)
        return validation_error(RequestValidationError(errors), None)
    return bad_request(exc)


def read_body(
    payload: bytes,
    content_type: str | None,
    request_type: Callable[[Any], type[BaseModel]],
) -> BaseModel:
    """A POST body read and validated as FastAPI reads a route's one body parameter, for a
    handler that takes the raw request (the router's ``/debug/route``): JSON only under a JSON
    content type (``application/json``, ``application/*+json``).

    Args:
        payload: the body's bytes.
        content_type: the request's ``Content-Type`` header, if any.
        request_type: the model to validate with, given the parsed body (e.g.
            ``ChatCompletionRequest`` when it has ``messages``).

    Raises:
        OpenAIError: the 400 the engine's routes answer for the same body (``validation_error``).
    """
    body: Any = payload
    subtype = None
    if content_type:
        header = email.message.Message()
        header["content-type"] = content_type
        if header.get_content_maintype() == "application":
            subtype = header.get_content_subtype()
    if not payload:
        missing = {"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}
        raise validation_error(RequestValidationError([missing]), content_type)
    if subtype == "json" or (subtype or "").endswith("+json"):
        try:
            body = json.loads(payload)
        except json.JSONDecodeError as exc:
            invalid = {"type": "json_invalid", "loc": ("body", exc.pos), "ctx": {"error": exc.msg}}
            error = RequestValidationError([invalid], body=exc.doc)
            raise validation_error(error, content_type) from None
        except (UnicodeDecodeError, RecursionError):  # FastAPI's own answer for them
            raise OpenAIError(
                HTTPStatus.BAD_REQUEST, "There was an error parsing the body"
            ) from None
    try:
        return request_type(body).model_validate(body, from_attributes=True)
    except RecursionError:
        raise OpenAIError(HTTPStatus.BAD_REQUEST, "the request body is nested too deeply") from None
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        raise validation_error(RequestValidationError(errors, body=body), content_type) from None


def install_error_handlers(app: FastAPI) -> None:
    """Make every error path of ``app`` answer with OpenAI's error body."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc, request.headers.get("content-type")).response()

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
