"""OpenAI-shaped errors: the exception routes raise, the JSON body clients read, and the handlers
that turn every failure - ours, the request validator's, an unexpected one - into that body with
the right status, counted in `prefixkv:http_request_errors_total`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("prefixkv.server")

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    409: "ConflictError",
    413: "RequestEntityTooLarge",
    499: "ClientClosedRequest",
    503: "ServiceUnavailableError",
}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    """An error answered to the client as-is (OpenAI's error body)."""

    def __init__(self, message: str, status: int = 400, type_: str | None = None, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type_ or _TYPES.get(status, "InternalServerError")
        self.param = param


class EngineDeadError(RuntimeError):
    """The engine is not running (shutting down, or failed): 503."""


def error_body(message: str, status: int, type_: str | None = None, param: str | None = None) -> dict:
    err = APIError(message, status, type_, param)
    return ErrorResponse(error=ErrorInfo(message=err.message, type=err.type, param=err.param, code=status)).model_dump()


def error_response(message: str, status: int, type_: str | None = None, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, type_, param), status_code=status)


def validation_message(e: ValidationError) -> str:
    """A request model's validation errors as one message: `field.path: why; ...`."""
    return "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors())


def as_api_error(exc: BaseException) -> APIError:
    """What a failure means to the client: our own errors keep their status, bad values are 400,
    a stopped engine is 503, anything else is an internal error (500)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return APIError(str(exc), 503)
    if isinstance(exc, (ValueError, TypeError)):  # UnicodeError is a ValueError: bad input
        return APIError(str(exc) or type(exc).__name__, 400)
    return APIError(f"internal error: {type(exc).__name__}: {exc}", 500)


def install_error_handlers(app: FastAPI, count_error: Callable[[int], None]) -> None:
    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError) -> JSONResponse:
        count_error(exc.status)
        return error_response(exc.message, exc.status, exc.type, exc.param)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        count_error(400)
        errs = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errs):
            msg = "Malformed JSON in the request body: " + "; ".join(
                str(e.get("ctx", {}).get("error", e.get("msg"))) for e in errs
            )
        else:
            msg = "; ".join(
                f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body')}: {e.get('msg')}" for e in errs
            )
        return error_response(msg or "invalid request", 400, "BadRequestError")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        count_error(exc.status_code)
        phrase = HTTPStatus(exc.status_code).phrase.replace(" ", "")
        return error_response(str(exc.detail), exc.status_code, phrase)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_request: Request, exc: EngineDeadError) -> JSONResponse:
        count_error(503)
        return error_response(str(exc), 503)

    @app.exception_handler(ValueError)
    async def value_error(_request: Request, exc: ValueError) -> JSONResponse:
        count_error(400)
        return error_response(str(exc) or type(exc).__name__, 400)

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, exc: Exception) -> JSONResponse:
        # Starlette calls this from its outermost middleware: the 500 is still counted and
        # OpenAI-shaped, and the traceback goes to the log, not to the client.
        logger.error("unhandled error", exc_info=exc)
        count_error(500)
        return error_response(f"internal error: {type(exc).__name__}", 500)
