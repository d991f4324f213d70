"""Chat request validation (no I/O): ``messages`` normalized as a chat template takes them, ``tools``
(only with ``tool_choice: "none"``), ``reasoning_effort`` and the validated-only chat parameters.
Rules: vLLM 0.32's ``ChatCompletionRequest`` (vllm/entrypoints/openai/chat_completion/protocol.py) and
its chat utilities (vllm/renderers/chat_utils.py); each refusal an :class:`~.responses.ApiError`
naming the parameter."""

from __future__ import annotations

from typing import Any

from kairos.contracts.errors import ErrorCode
from kairos.services.ingress.openai_api.fields import bool_field, show
from kairos.services.ingress.openai_api.responses import ApiError

#: The fields a chat message may carry (OpenAI's message objects); anything else is refused.
CHAT_MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})

#: The chat roles OpenAI defines. Any other non-empty role is accepted too and passed to the chat
#: template, as vLLM 0.32 does (``CustomChatCompletionMessageParam``, vllm/renderers/chat_utils.py).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

#: ``reasoning_effort`` values (vLLM 0.32 ``ChatCompletionRequest.reasoning_effort``).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def chat_content(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(ErrorCode.INVALID_VALUE, f"messages[{i}].content[{j}]: only text parts are supported",
                               param=f"messages[{i}].content")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(ErrorCode.INVALID_TYPE, f"messages[{i}].content must be a string or a list of text parts",
                   param=f"messages[{i}].content")


def tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` history: ``[{id, type: "function", function: {name, arguments}}]``."""
    param = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise ApiError(ErrorCode.INVALID_TYPE, f"{param} must be a list, got {show(calls)}", param=param)
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if (not isinstance(fn, dict) or not isinstance(fn.get("name"), str)
                or not isinstance(fn.get("arguments", ""), str) or c.get("type", "function") != "function"):
            raise ApiError(ErrorCode.INVALID_TYPE,
                           f"{param}[{j}] must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\": "
                           f"string, \"arguments\": string}}}}", param=param)
        out.append({"id": str(c.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": fn.get("arguments", "")}})
    return out


def chat_messages(msgs: Any) -> list[dict[str, Any]]:
    """Validated, normalized chat messages (``role``, ``content`` text, optional ``tool_calls`` /
    ``tool_call_id`` / ``name``), as a chat template takes them."""
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(ErrorCode.MISSING_REQUIRED_PARAMETER if msgs is None else ErrorCode.INVALID_TYPE,
                       "'messages' must be a non-empty list", param="messages")
    norm = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(ErrorCode.INVALID_TYPE,
                           f"messages[{i}] must be an object with a 'role'", param=f"messages[{i}]")
        if not m["role"]:  # any other role goes to the template (CHAT_ROLES)
            raise ApiError(ErrorCode.INVALID_VALUE, f"messages[{i}].role must not be empty",
                           param=f"messages[{i}].role")
        unknown = sorted(set(m) - CHAT_MESSAGE_FIELDS)
        if unknown:
            raise ApiError(ErrorCode.INVALID_VALUE,
                           f"messages[{i}] has unsupported field(s) {', '.join(map(repr, unknown))} (supported: "
                           f"{', '.join(sorted(CHAT_MESSAGE_FIELDS))})", param=f"messages[{i}].{unknown[0]}")
        content = m.get("content")
        if content is None:
            if m["role"] != "assistant" or m.get("tool_calls") is None:  # only a tool-calling turn may omit it
                raise ApiError(ErrorCode.MISSING_REQUIRED_PARAMETER,
                               f"messages[{i}].content is required for role {m['role']!r}",
                               param=f"messages[{i}].content")
            content = ""
        if m["role"] == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise ApiError(ErrorCode.MISSING_REQUIRED_PARAMETER,
                           f"messages[{i}]: a tool message needs 'tool_call_id' (the id of the call it answers)",
                           param=f"messages[{i}].tool_call_id")
        msg: dict[str, Any] = {"role": m["role"], "content": chat_content(content, i)}
        if m.get("tool_calls") is not None:
            if m["role"] != "assistant":
                raise ApiError(ErrorCode.INVALID_VALUE,
                               f"messages[{i}].tool_calls is only allowed on assistant messages",
                               param=f"messages[{i}].tool_calls")
            msg["tool_calls"] = tool_calls(m["tool_calls"], i)
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise ApiError(ErrorCode.INVALID_TYPE,
                                   f"messages[{i}].{key} must be a string", param=f"messages[{i}].{key}")
                msg[key] = m[key]
        norm.append(msg)
    return norm


def tools_for_template(body: dict) -> list[dict[str, Any]] | None:
    """``tools`` (function tools) for the chat template; only with ``tool_choice: "none"`` (vLLM
    defaults ``tool_choice`` to ``auto`` when tools are given, which needs a tool-call parser)."""
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise ApiError(ErrorCode.INVALID_TYPE, f"'tools' must be a list of function tools, got {show(tools)}",
                       param="tools")
    for j, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if (not isinstance(fn, dict) or t.get("type", "function") != "function" or not isinstance(fn.get("name"), str)
                or not isinstance(fn.get("parameters", {}), dict)):
            raise ApiError(ErrorCode.INVALID_TYPE, f"tools[{j}] must be {{\"type\": \"function\", \"function\": "
                                                   f"{{\"name\": string, \"parameters\": object}}}}", param="tools")
    if body.get("tool_choice") != "none":
        raise ApiError(ErrorCode.UNSUPPORTED_PARAMETER,
                       "'tools' are supported only with \"tool_choice\": \"none\" (rendered into the prompt, no "
                       "tool calls parsed): Kairos does not parse tool calls out of the output, and without "
                       "tool_choice the default is \"auto\"", param="tools")
    return tools


def chat_options(body: dict, model_template: bool) -> tuple[list[dict[str, Any]] | None, dict[str, Any], list[str]]:
    """(tools, chat template keyword arguments, names ignored) of a chat request: ``tools`` and
    ``reasoning_effort`` go to the template (vLLM: ``build_chat_params``, which also sets
    ``enable_thinking``); ``store``, ``metadata``, ``parallel_tool_calls`` are validated only."""
    bool_field(body, "store")
    bool_field(body, "parallel_tool_calls")
    meta = body.get("metadata")
    if meta is not None and (not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values())):
        raise ApiError(ErrorCode.INVALID_TYPE, f"'metadata' must be an object of string values, got {show(meta)}",
                       param="metadata")
    kwargs: dict[str, Any] = {}
    ignored: list[str] = []
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise ApiError(ErrorCode.INVALID_VALUE, f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, "
                                                    f"got {show(effort)}", param="reasoning_effort")
        if model_template:
            kwargs = {"reasoning_effort": effort, "enable_thinking": effort != "none"}
        else:
            ignored.append("reasoning_effort")
    return tools_for_template(body), kwargs, ignored
