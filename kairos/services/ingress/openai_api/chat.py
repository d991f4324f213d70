"""The chat rules a model cannot say (no I/O): messages as a chat template takes them, ``tools`` only
with ``tool_choice: "none"``, ``reasoning_effort`` for the template.

Shapes and types are :class:`~.models.ChatCompletionRequest`'s (validated before); the rules are vLLM
0.32's ``ChatCompletionRequest`` (vllm/entrypoints/openai/chat_completion/protocol.py) and its chat
utilities (vllm/renderers/chat_utils.py); each refusal an :class:`~.responses.ApiError` naming the
parameter.
"""

from __future__ import annotations

from typing import Any

from kairos.contracts.errors import ErrorCode
from kairos.services.ingress.openai_api.models import ChatCompletionRequest, ChatMessage
from kairos.services.ingress.openai_api.responses import ApiError

#: The fields a chat message may carry (OpenAI's message objects); anything else is refused.
CHAT_MESSAGE_FIELDS = frozenset(ChatMessage.__struct_fields__)

#: The chat roles OpenAI defines. Any other non-empty role is accepted too and passed to the chat
#: template, as vLLM 0.32 does (``CustomChatCompletionMessageParam``, vllm/renderers/chat_utils.py).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_messages(msgs: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as a chat template takes them (``role``, ``content`` text, optional
    ``tool_calls`` / ``tool_call_id`` / ``name``). Only an assistant turn with ``tool_calls`` may
    leave out ``content``; a ``tool`` message names the call it answers; only assistants call tools.

    Raises:
        ApiError: 400 naming ``messages[i].<field>``.
    """
    norm = []
    for i, m in enumerate(msgs):
        if m.content is None and (m.role != "assistant" or m.tool_calls is None):
            raise ApiError(ErrorCode.MISSING_REQUIRED_PARAMETER,
                           f"messages[{i}].content is required for role {m.role!r}", param=f"messages[{i}].content")
        if m.role == "tool" and m.tool_call_id is None:
            raise ApiError(ErrorCode.MISSING_REQUIRED_PARAMETER,
                           f"messages[{i}]: a tool message needs 'tool_call_id' (the id of the call it answers)",
                           param=f"messages[{i}].tool_call_id")
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or ())
        msg: dict[str, Any] = {"role": m.role, "content": content}
        if m.tool_calls is not None:
            if m.role != "assistant":
                raise ApiError(ErrorCode.INVALID_VALUE, f"messages[{i}].tool_calls is only allowed on assistant "
                                                        "messages", param=f"messages[{i}].tool_calls")
            msg["tool_calls"] = [{"id": c.id or "", "type": "function",
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for c in m.tool_calls]
        msg.update({k: v for k in ("tool_call_id", "name") if (v := getattr(m, k)) is not None})
        norm.append(msg)
    return norm


def chat_options(req: ChatCompletionRequest, body: dict[str, Any],
                 model_template: bool) -> tuple[list[dict[str, Any]] | None, dict[str, Any], list[str]]:
    """(tools, chat template keyword arguments, names ignored) of a chat request: ``tools`` (as sent)
    only with ``tool_choice: "none"`` (vLLM defaults it to ``auto``, which needs a tool-call parser),
    ``reasoning_effort`` to the model's template (vLLM: ``build_chat_params``, which also sets
    ``enable_thinking``), named as ignored without one.

    Raises:
        ApiError: 400 ``unsupported_parameter`` naming ``tools``.
    """
    tools = body["tools"] if req.tools else None
    if tools and req.tool_choice != "none":
        raise ApiError(ErrorCode.UNSUPPORTED_PARAMETER,
                       "'tools' are supported only with \"tool_choice\": \"none\" (rendered into the prompt, no "
                       "tool calls parsed): Kairos does not parse tool calls out of the output, and without "
                       "tool_choice the default is \"auto\"", param="tools")
    effort = req.reasoning_effort
    if effort is None:
        return tools, {}, []
    if not model_template:
        return tools, {}, ["reasoning_effort"]
    return tools, {"reasoning_effort": effort, "enable_thinking": effort != "none"}, []
