"""``POST /invocations``: vLLM's (Amazon SageMaker's) one inference route, a chat completion or a
completion by what its body holds.

SageMaker sends every inference request to ``/invocations`` (and health checks to ``/ping``);
vLLM's server answers it by validating the body as a chat completion request, then as a
completion request, and serving the first that fits. Here the body's keys decide the same way
(``messages``: chat; else ``prompt``: a completion), so that a chat body with a bad field gets
the chat route's own 400 naming that field instead of a list of request types. The response is
the one ``/v1/chat/completions`` or ``/v1/completions`` gives, streamed when the body asks for
it. Unlike vLLM, which leaves the route open (SageMaker authenticates at its edge),
``--api-key`` guards it as it does ``/v1``.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from kvpilot.engine.server.errors import OpenAIError
from kvpilot.engine.server.protocol import ChatCompletionRequest, CompletionRequest

PATH = "/invocations"


def is_chat(body: dict[str, Any]) -> bool:
    """Whether an ``/invocations`` JSON object is a chat completion (``messages``, not null);
    the router plans its prompt by the same rule."""
    return body.get("messages") is not None


def invocation_request_type(body: Any) -> type[ChatCompletionRequest | CompletionRequest]:
    """The request an ``/invocations`` body is: a chat completion when it has ``messages`` (not
    null), a completion when it has ``prompt``; a body that is not a JSON object is read as a
    completion, so that it gets the completion route's 400 (which names a content type that is
    not JSON, when that is why).

    Raises:
        OpenAIError: 400 for a JSON object with neither key.
    """
    if not isinstance(body, dict):
        return CompletionRequest
    if is_chat(body):
        return ChatCompletionRequest
    if "prompt" in body:
        return CompletionRequest
    raise OpenAIError(
        HTTPStatus.BAD_REQUEST,
        "an /invocations body must be a chat completion request (with 'messages') or a "
        "completion request (with 'prompt')",
    )
