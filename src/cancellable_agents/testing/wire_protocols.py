"""The model providers' wire protocols the scripted server speaks, each closely enough for its real SDK.

The scripted server ([`cancellable_agents.testing.openai_server`][]) plays one script (the model
string, [`cancellable_agents.testing.scripts`][]) and watches the client the same way whatever the
protocol; what differs between providers is only the request's shape and the bytes of the answer.
That difference lives here, one [`WireProtocol`][] per provider API, chosen by the request's path
([`route`][]):

- OpenAI chat completions (SSE; the ``openai``, ``mistralai`` and ``groq`` SDKs):
  ``/v1/chat/completions``, ``/openai/v1/chat/completions`` (Groq's);
- OpenAI responses (SSE): ``/v1/responses``;
- Anthropic messages (SSE): ``/v1/messages``;
- Gemini (SSE; ``google-genai``): ``/{version}/models/{m}:streamGenerateContent`` (or
  ``:generateContent``), also under Vertex AI's ``projects/{p}/locations/{l}/publishers/google/``;
- Bedrock Converse (``application/vnd.amazon.eventstream``; ``botocore``):
  ``/model/{m}/converse-stream``, ``/model/{m}/converse``.

A protocol turns the request body into a [`WireRequest`][] (the conversation normalised to chat
messages: ``role`` ``user``/``assistant``/``tool`` and text ``content``, which is what the scripts read)
and a [`Reply`][cancellable_agents.testing.scripts.Reply] into frames: the opening, one text piece, one
tool call, the closing, and the whole answer for a non-streaming request. Where the model name travels in
the URL (Gemini, Bedrock) it is percent-decoded: quote a script with ``urllib.parse.quote(model, safe="")``
for an SDK that does not quote its path itself (``google-genai``).

Stdlib only, like the server.
"""

from __future__ import annotations

import binascii
import json
import re
import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from cancellable_agents.testing.scripts import Completion, Reply, ToolCall, message_text

__all__ = ["PROTOCOLS", "Route", "WireProtocol", "WireRequest", "eventstream_message", "route"]


@dataclass(frozen=True)
class WireRequest:
    """What the server needs of a request, whatever its protocol."""

    model: str
    stream: bool
    #: The conversation as chat messages (``role`` and text ``content``; tool results as ``role: tool``).
    messages: list[dict[str, Any]]
    #: The names of the tools the request offers.
    tools: list[str] = field(default_factory=list)
    #: OpenAI chat only: send the usage chunk at the end.
    include_usage: bool = False


class WireProtocol(ABC):
    """One provider API: its request shape and its answer's bytes (each method returns whole frames)."""

    name: str
    stream_content_type = "text/event-stream; charset=utf-8"

    @abstractmethod
    def parse(self, body: dict[str, Any], path_model: str | None, path_stream: bool | None) -> WireRequest:
        """The request; ``path_model``, ``path_stream``: what the URL says, where the protocol puts it."""

    @abstractmethod
    def opening(self, completion: Completion, reply: Reply) -> list[bytes]:
        """Frames sent once the answer starts (before the first piece)."""

    @abstractmethod
    def text(self, completion: Completion, reply: Reply, piece: str) -> list[bytes]:
        """Frames carrying one text piece (one token)."""

    @abstractmethod
    def tool_call(self, completion: Completion, reply: Reply, index: int, call: ToolCall) -> list[bytes]:
        """Frames carrying tool call ``index`` whole."""

    @abstractmethod
    def closing(self, completion: Completion, reply: Reply, request: WireRequest) -> list[bytes]:
        """Frames that end the answer (finish reason, usage, end marker)."""

    @abstractmethod
    def body(self, completion: Completion, reply: Reply) -> dict[str, Any]:
        """The whole answer to a non-streaming request."""


def _sse(payload: dict[str, Any], event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(payload)}\n\n".encode()


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text or "{}")
    return value if isinstance(value, dict) else {}


def _require(body: dict[str, Any], key: str, kind: type) -> Any:
    value = body.get(key)
    if not isinstance(value, kind) or not value:
        raise ValueError(f"'{key}' must be a non-empty {kind.__name__}")
    return value


# ---------------------------------------------------------------------------------------------------------
# OpenAI chat completions (also Mistral's and Groq's API)
# ---------------------------------------------------------------------------------------------------------


class OpenAIChat(WireProtocol):
    name = "openai-chat"

    def parse(self, body: dict[str, Any], path_model: str | None, path_stream: bool | None) -> WireRequest:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise ValueError("'model' must be a non-empty string")
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("'messages' must be a list of objects")
        options = body.get("stream_options") or {}
        tools = body.get("tools")
        tools = tools if isinstance(tools, list) else []
        names = [t.get("function", {}).get("name") for t in tools if isinstance(t, dict)]
        return WireRequest(
            model,
            bool(body.get("stream", False)),
            messages,
            [n for n in names if isinstance(n, str)],
            include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        )

    def opening(self, completion: Completion, reply: Reply) -> list[bytes]:
        if reply.tool_calls:
            return []
        return [_sse(completion.chunk({"role": "assistant", "content": ""}))]

    def text(self, completion: Completion, reply: Reply, piece: str) -> list[bytes]:
        return [_sse(completion.chunk({"content": piece}))]

    def tool_call(self, completion: Completion, reply: Reply, index: int, call: ToolCall) -> list[bytes]:
        # The whole call in one delta: Mistral's SDK requires the name in every tool-call delta.
        function = {"name": call.name, "arguments": call.arguments}
        delta: dict[str, Any] = {
            "tool_calls": [{"index": index, "id": call.id, "type": "function", "function": function}]
        }
        if index == 0:
            delta = {"role": "assistant", "content": None, **delta}
        return [_sse(completion.chunk(delta))]

    def closing(self, completion: Completion, reply: Reply, request: WireRequest) -> list[bytes]:
        frames = [_sse(completion.chunk({}, finish_reason=reply.finish_reason))]
        if request.include_usage:
            frames.append(_sse(completion.usage_chunk(reply.completion_tokens)))
        return [*frames, b"data: [DONE]\n\n"]

    def body(self, completion: Completion, reply: Reply) -> dict[str, Any]:
        return completion.body(reply)


# ---------------------------------------------------------------------------------------------------------
# OpenAI responses
# ---------------------------------------------------------------------------------------------------------


class OpenAIResponses(WireProtocol):
    name = "openai-responses"

    def parse(self, body: dict[str, Any], path_model: str | None, path_stream: bool | None) -> WireRequest:
        model = _require(body, "model", str)
        items = body.get("input")
        items = [{"role": "user", "content": items}] if isinstance(items, str) else items or []
        messages: list[dict[str, Any]] = []
        for item in items:
            if not isinstance(item, dict):
                continue
            if item.get("type") == "function_call_output":
                messages.append({"role": "tool", "content": str(item.get("output", ""))})
            elif item.get("type") == "function_call":
                messages.append({"role": "assistant", "content": ""})
            elif item.get("role") in ("user", "assistant", "system", "developer"):
                content = item.get("content")
                if isinstance(content, list):
                    content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
                messages.append({"role": item["role"], "content": content or ""})
        tools = [t.get("name") for t in body.get("tools") or [] if isinstance(t, dict)]
        return WireRequest(
            model, bool(body.get("stream")), messages, [t for t in tools if isinstance(t, str)]
        )

    def _response(self, completion: Completion, status: str, output: list[Any], tokens: int | None) -> Any:
        response: dict[str, Any] = {
            "id": f"resp_{completion.id}",
            "object": "response",
            "created_at": completion.created,
            "model": completion.model,
            "status": status,
            "output": output,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "error": None,
            "incomplete_details": None,
            "instructions": None,
            "metadata": {},
        }
        if tokens is not None:
            response["usage"] = {
                "input_tokens": completion.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": completion.prompt_tokens + tokens,
            }
        return response

    def _event(self, kind: str, **data: Any) -> bytes:
        return _sse({"type": kind, "sequence_number": 0, **data}, kind)

    def _message_id(self, completion: Completion) -> str:
        return f"msg_{completion.id}"

    def opening(self, completion: Completion, reply: Reply) -> list[bytes]:
        frames = [
            self._event("response.created", response=self._response(completion, "in_progress", [], None))
        ]
        if reply.pieces:
            item = {"id": self._message_id(completion), "type": "message", "role": "assistant"}
            frames += [
                self._event(
                    "response.output_item.added",
                    output_index=0,
                    item={**item, "status": "in_progress", "content": []},
                ),
                self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=0,
                    content_index=0,
                    part={"type": "output_text", "text": "", "annotations": []},
                ),
            ]
        return frames

    def text(self, completion: Completion, reply: Reply, piece: str) -> list[bytes]:
        return [
            self._event(
                "response.output_text.delta",
                item_id=self._message_id(completion),
                output_index=0,
                content_index=0,
                delta=piece,
                logprobs=[],
            )
        ]

    def _output(self, completion: Completion, reply: Reply) -> list[dict[str, Any]]:
        output: list[dict[str, Any]] = []
        if reply.pieces:
            text = {"type": "output_text", "text": "".join(reply.pieces), "annotations": []}
            output.append(
                {
                    "id": self._message_id(completion),
                    "type": "message",
                    "role": "assistant",
                    "status": "completed",
                    "content": [text],
                }
            )
        for call in reply.tool_calls:
            output.append(
                {
                    "id": f"fc_{call.id}",
                    "type": "function_call",
                    "call_id": call.id,
                    "name": call.name,
                    "arguments": call.arguments,
                    "status": "completed",
                }
            )
        return output

    def tool_call(self, completion: Completion, reply: Reply, index: int, call: ToolCall) -> list[bytes]:
        position = index + (1 if reply.pieces else 0)
        item = self._output(completion, reply)[position]
        return [
            self._event(
                "response.output_item.added",
                output_index=position,
                item={**item, "arguments": "", "status": "in_progress"},
            ),
            self._event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=position,
                delta=call.arguments,
            ),
            self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=position,
                arguments=call.arguments,
            ),
            self._event("response.output_item.done", output_index=position, item=item),
        ]

    def closing(self, completion: Completion, reply: Reply, request: WireRequest) -> list[bytes]:
        output = self._output(completion, reply)
        frames = []
        if reply.pieces:
            text = "".join(reply.pieces)
            message_id = self._message_id(completion)
            frames += [
                self._event(
                    "response.output_text.done",
                    item_id=message_id,
                    output_index=0,
                    content_index=0,
                    text=text,
                    logprobs=[],
                ),
                self._event(
                    "response.content_part.done",
                    item_id=message_id,
                    output_index=0,
                    content_index=0,
                    part=output[0]["content"][0],
                ),
                self._event("response.output_item.done", output_index=0, item=output[0]),
            ]
        response = self._response(completion, "completed", output, reply.completion_tokens)
        return [*frames, self._event("response.completed", response=response)]

    def body(self, completion: Completion, reply: Reply) -> dict[str, Any]:
        return dict(
            self._response(completion, "completed", self._output(completion, reply), reply.completion_tokens)
        )


# ---------------------------------------------------------------------------------------------------------
# Anthropic messages
# ---------------------------------------------------------------------------------------------------------


def _blocks_to_messages(role: str, content: Any, result_keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """A message whose content is a list of blocks, as chat messages: each tool result block is a
    ``role: tool`` message, the text blocks one message of ``role``."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    blocks = [b for b in content or [] if isinstance(b, dict)]
    results = [b for b in blocks if any(key in b or b.get("type") == key for key in result_keys)]
    texts = "".join(str(b.get("text", "")) for b in blocks if isinstance(b.get("text"), str))
    messages = [{"role": "tool", "content": ""} for _ in results]
    if texts or not results:
        messages.append({"role": role, "content": texts})
    return messages


class AnthropicMessages(WireProtocol):
    name = "anthropic"

    def parse(self, body: dict[str, Any], path_model: str | None, path_stream: bool | None) -> WireRequest:
        model = _require(body, "model", str)
        messages: list[dict[str, Any]] = []
        for message in _require(body, "messages", list):
            if isinstance(message, dict):
                messages += _blocks_to_messages(
                    message.get("role", "user"), message.get("content"), ("tool_result",)
                )
        tools = [t.get("name") for t in body.get("tools") or [] if isinstance(t, dict)]
        return WireRequest(
            model, bool(body.get("stream")), messages, [t for t in tools if isinstance(t, str)]
        )

    @staticmethod
    def _stop_reason(reply: Reply) -> str:
        return "tool_use" if reply.tool_calls else "end_turn"

    def opening(self, completion: Completion, reply: Reply) -> list[bytes]:
        message: dict[str, Any] = {
            "id": f"msg_{completion.id}",
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": completion.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": completion.prompt_tokens, "output_tokens": 0},
        }
        frames = [_sse({"type": "message_start", "message": message}, "message_start")]
        if reply.pieces:
            block = {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
            frames.append(_sse(block, "content_block_start"))
        return frames

    def text(self, completion: Completion, reply: Reply, piece: str) -> list[bytes]:
        delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}}
        return [_sse(delta, "content_block_delta")]

    def tool_call(self, completion: Completion, reply: Reply, index: int, call: ToolCall) -> list[bytes]:
        frames = []
        if index == 0 and reply.pieces:
            frames.append(_sse({"type": "content_block_stop", "index": 0}, "content_block_stop"))
        position = index + (1 if reply.pieces else 0)
        block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": call.arguments}
        return [
            *frames,
            _sse(
                {"type": "content_block_start", "index": position, "content_block": block},
                "content_block_start",
            ),
            _sse({"type": "content_block_delta", "index": position, "delta": delta}, "content_block_delta"),
            _sse({"type": "content_block_stop", "index": position}, "content_block_stop"),
        ]

    def closing(self, completion: Completion, reply: Reply, request: WireRequest) -> list[bytes]:
        frames = []
        if reply.pieces and not reply.tool_calls:
            frames.append(_sse({"type": "content_block_stop", "index": 0}, "content_block_stop"))
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": self._stop_reason(reply), "stop_sequence": None},
            "usage": {"output_tokens": reply.completion_tokens},
        }
        return [*frames, _sse(delta, "message_delta"), _sse({"type": "message_stop"}, "message_stop")]

    def body(self, completion: Completion, reply: Reply) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if reply.pieces:
            content.append({"type": "text", "text": "".join(reply.pieces)})
        for call in reply.tool_calls:
            content.append(
                {"type": "tool_use", "id": call.id, "name": call.name, "input": _json_object(call.arguments)}
            )
        return {
            "id": f"msg_{completion.id}",
            "type": "message",
            "role": "assistant",
            "model": completion.model,
            "content": content,
            "stop_reason": self._stop_reason(reply),
            "stop_sequence": None,
            "usage": {"input_tokens": completion.prompt_tokens, "output_tokens": reply.completion_tokens},
        }


# ---------------------------------------------------------------------------------------------------------
# Gemini (the Gemini API and Vertex AI)
# ---------------------------------------------------------------------------------------------------------


class Gemini(WireProtocol):
    name = "gemini"

    def parse(self, body: dict[str, Any], path_model: str | None, path_stream: bool | None) -> WireRequest:
        if not path_model:
            raise ValueError("the model is named in the path: .../models/MODEL:streamGenerateContent")
        messages: list[dict[str, Any]] = []
        for content in _require(body, "contents", list):
            if not isinstance(content, dict):
                continue
            role = "assistant" if content.get("role") == "model" else "user"
            messages += _blocks_to_messages(
                role, content.get("parts"), ("functionResponse", "function_response")
            )
        tools = []
        for tool in body.get("tools") or []:
            declarations = tool.get("functionDeclarations") or tool.get("function_declarations") or []
            tools += [d.get("name") for d in declarations if isinstance(d, dict)]
        return WireRequest(path_model, bool(path_stream), messages, [t for t in tools if isinstance(t, str)])

    def _chunk(
        self, completion: Completion, parts: list[dict[str, Any]], finish: str | None, tokens: int
    ) -> Any:
        candidate: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": 0}
        if finish:
            candidate["finishReason"] = finish
        return {
            "candidates": [candidate],
            "usageMetadata": {
                "promptTokenCount": completion.prompt_tokens,
                "candidatesTokenCount": tokens,
                "totalTokenCount": completion.prompt_tokens + tokens,
            },
            "modelVersion": completion.model,
            "responseId": completion.id,
        }

    @staticmethod
    def _call_part(call: ToolCall) -> dict[str, Any]:
        return {"functionCall": {"id": call.id, "name": call.name, "args": _json_object(call.arguments)}}

    def opening(self, completion: Completion, reply: Reply) -> list[bytes]:
        return []

    def text(self, completion: Completion, reply: Reply, piece: str) -> list[bytes]:
        return [_sse(self._chunk(completion, [{"text": piece}], None, 0))]

    def tool_call(self, completion: Completion, reply: Reply, index: int, call: ToolCall) -> list[bytes]:
        return [_sse(self._chunk(completion, [self._call_part(call)], None, 0))]

    def closing(self, completion: Completion, reply: Reply, request: WireRequest) -> list[bytes]:
        return [_sse(self._chunk(completion, [{"text": ""}], "STOP", reply.completion_tokens))]

    def body(self, completion: Completion, reply: Reply) -> dict[str, Any]:
        parts = [{"text": "".join(reply.pieces)}] if reply.pieces else []
        parts += [self._call_part(call) for call in reply.tool_calls]
        return dict(self._chunk(completion, parts, "STOP", reply.completion_tokens))


# ---------------------------------------------------------------------------------------------------------
# Bedrock Converse
# ---------------------------------------------------------------------------------------------------------


def _eventstream_header(name: str, value: str) -> bytes:
    """One header of type 7 (string): name length (1 byte), name, type, value length (2 bytes), value."""
    raw_name, raw_value = name.encode(), value.encode()
    return struct.pack("!B", len(raw_name)) + raw_name + struct.pack("!BH", 7, len(raw_value)) + raw_value


def eventstream_message(headers: dict[str, str], payload: bytes) -> bytes:
    """One ``application/vnd.amazon.eventstream`` message, as ``botocore.eventstream`` decodes it.

    The prelude is the total length and the headers' length (big-endian uint32 each) and the CRC32
    of those 8 bytes; then the headers, the payload, and the CRC32 of everything before it.
    """
    raw_headers = b"".join(_eventstream_header(name, value) for name, value in headers.items())
    total = 12 + len(raw_headers) + len(payload) + 4
    prelude = struct.pack("!II", total, len(raw_headers))
    head = prelude + struct.pack("!I", binascii.crc32(prelude) & 0xFFFFFFFF)
    message = head + raw_headers + payload
    return message + struct.pack("!I", binascii.crc32(message) & 0xFFFFFFFF)


class BedrockConverse(WireProtocol):
    name = "bedrock-converse"
    stream_content_type = "application/vnd.amazon.eventstream"

    def parse(self, body: dict[str, Any], path_model: str | None, path_stream: bool | None) -> WireRequest:
        if not path_model:
            raise ValueError("the model is named in the path: /model/MODEL/converse-stream")
        messages: list[dict[str, Any]] = []
        for message in _require(body, "messages", list):
            if isinstance(message, dict):
                messages += _blocks_to_messages(
                    message.get("role", "user"), message.get("content"), ("toolResult",)
                )
        config = body.get("toolConfig") or {}
        specs = [t.get("toolSpec", {}) for t in config.get("tools") or [] if isinstance(t, dict)]
        tools = [s.get("name") for s in specs if isinstance(s, dict)]
        return WireRequest(path_model, bool(path_stream), messages, [t for t in tools if isinstance(t, str)])

    @staticmethod
    def _event(kind: str, payload: dict[str, Any]) -> bytes:
        headers = {":event-type": kind, ":content-type": "application/json", ":message-type": "event"}
        return eventstream_message(headers, json.dumps(payload).encode())

    @staticmethod
    def _stop_reason(reply: Reply) -> str:
        return "tool_use" if reply.tool_calls else "end_turn"

    def _usage(self, completion: Completion, tokens: int) -> dict[str, int]:
        return {
            "inputTokens": completion.prompt_tokens,
            "outputTokens": tokens,
            "totalTokens": completion.prompt_tokens + tokens,
        }

    def opening(self, completion: Completion, reply: Reply) -> list[bytes]:
        return [self._event("messageStart", {"role": "assistant"})]

    def text(self, completion: Completion, reply: Reply, piece: str) -> list[bytes]:
        return [self._event("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"text": piece}})]

    def tool_call(self, completion: Completion, reply: Reply, index: int, call: ToolCall) -> list[bytes]:
        frames = []
        if index == 0 and reply.pieces:
            frames.append(self._event("contentBlockStop", {"contentBlockIndex": 0}))
        position = index + (1 if reply.pieces else 0)
        start = {"toolUse": {"toolUseId": call.id, "name": call.name}}
        return [
            *frames,
            self._event("contentBlockStart", {"contentBlockIndex": position, "start": start}),
            self._event(
                "contentBlockDelta",
                {"contentBlockIndex": position, "delta": {"toolUse": {"input": call.arguments}}},
            ),
            self._event("contentBlockStop", {"contentBlockIndex": position}),
        ]

    def closing(self, completion: Completion, reply: Reply, request: WireRequest) -> list[bytes]:
        frames = []
        if reply.pieces and not reply.tool_calls:
            frames.append(self._event("contentBlockStop", {"contentBlockIndex": 0}))
        metadata = {"usage": self._usage(completion, reply.completion_tokens), "metrics": {"latencyMs": 1}}
        return [
            *frames,
            self._event("messageStop", {"stopReason": self._stop_reason(reply)}),
            self._event("metadata", metadata),
        ]

    def body(self, completion: Completion, reply: Reply) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if reply.pieces:
            content.append({"text": "".join(reply.pieces)})
        for call in reply.tool_calls:
            content.append(
                {"toolUse": {"toolUseId": call.id, "name": call.name, "input": _json_object(call.arguments)}}
            )
        return {
            "output": {"message": {"role": "assistant", "content": content}},
            "stopReason": self._stop_reason(reply),
            "usage": self._usage(completion, reply.completion_tokens),
            "metrics": {"latencyMs": 1},
        }


# ---------------------------------------------------------------------------------------------------------
# Routing
# ---------------------------------------------------------------------------------------------------------

PROTOCOLS: dict[str, WireProtocol] = {
    p.name: p for p in (OpenAIChat(), OpenAIResponses(), AnthropicMessages(), Gemini(), BedrockConverse())
}
"""Every protocol the server speaks, by name."""

_ROUTES: tuple[tuple[re.Pattern[str], str], ...] = (
    # OpenAI's, Mistral's and Groq's (``/openai/v1``) paths, and Azure OpenAI's deployments.
    (re.compile(r"(?:/openai)?(?:/v1|/deployments/[^/]+)?/chat/completions"), "openai-chat"),
    (re.compile(r"/v1/responses"), "openai-responses"),
    (re.compile(r"/v1/messages"), "anthropic"),
    (
        re.compile(
            r"/v1(?:beta1?)?/(?:projects/[^/]+/locations/[^/]+/publishers/google/)?models/"
            r"(?P<model>[^/:]+):(?P<method>streamGenerateContent|generateContent)"
        ),
        "gemini",
    ),
    (re.compile(r"/model/(?P<model>[^/]+)/(?P<method>converse-stream|converse)"), "bedrock-converse"),
)


@dataclass(frozen=True)
class Route:
    """Which protocol a path speaks, and what the path says of the model and of streaming."""

    protocol: WireProtocol
    model: str | None = None
    stream: bool | None = None


def route(path: str) -> Route | None:
    """The protocol ``path`` (without its query) belongs to; ``None``: no model endpoint."""
    for pattern, name in _ROUTES:
        match = pattern.fullmatch(path)
        if match is None:
            continue
        groups = match.groupdict()
        model = unquote(groups["model"]) if groups.get("model") else None
        method = groups.get("method")
        stream = None if method is None else method in ("streamGenerateContent", "converse-stream")
        return Route(PROTOCOLS[name], model, stream)
    return None


def text_of(messages: list[dict[str, Any]]) -> int:
    """How many words the conversation holds (the prompt's token count)."""
    return sum(len(message_text(m).split()) for m in messages)
