"""An agent in plain Python: the openai SDK's streamed chat completions in a
loop of its own, its tools through the mcp SDK's streamable HTTP client.

Configured only by its environment: the task in AGENTRUN_INPUT, the MCP
servers' URLs in MCP_URLS (comma-separated), the model in MODEL (default
gpt-4o-mini); the SDK reads OPENAI_BASE_URL and OPENAI_API_KEY itself.
Prints its answer and writes it to $AGENTRUN_RESULT_FILE when set.
"""

import asyncio
import json
import os
import sys
from contextlib import AsyncExitStack

from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from openai import AsyncOpenAI

SYSTEM = "You are a helpful assistant. Use the tools when they help."
MAX_TURNS = 20


async def open_sessions(stack, urls):
    """A session per MCP server, and which session serves each tool."""
    by_tool, tools = {}, []
    for url in urls:
        read, write, _ = await stack.enter_async_context(streamable_http_client(url))
        session = await stack.enter_async_context(ClientSession(read, write))
        await session.initialize()
        for tool in (await session.list_tools()).tools:
            by_tool[tool.name] = session
            tools.append(
                {
                    "type": "function",
                    "function": {
                        "name": tool.name,
                        "description": tool.description or "",
                        "parameters": tool.inputSchema,
                    },
                }
            )
    return by_tool, tools


async def complete(client, model, messages, tools):
    """One streamed chat completion, gathered into its text and tool calls."""
    stream = await client.chat.completions.create(
        model=model, messages=messages, tools=tools or None, stream=True
    )
    text, calls = "", {}
    async for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += part.id or ""
            if part.function:
                call["name"] += part.function.name or ""
                call["arguments"] += part.function.arguments or ""
    return text, [calls[i] for i in sorted(calls)]


async def call_tool(by_tool, call):
    """The tool's result as text (an error as the model should see it)."""
    session = by_tool.get(call["name"])
    if session is None:
        return f"error: no tool named {call['name']}"
    result = await session.call_tool(call["name"], json.loads(call["arguments"] or "{}"))
    text = "\n".join(c.text for c in result.content if getattr(c, "text", None) is not None)
    return f"error: {text}" if result.isError else text


async def run(system):
    urls = [u.strip() for u in os.environ.get("MCP_URLS", "").split(",") if u.strip()]
    model = os.environ.get("MODEL", "gpt-4o-mini")
    client = AsyncOpenAI()
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": os.environ["AGENTRUN_INPUT"]},
    ]
    async with AsyncExitStack() as stack:
        by_tool, tools = await open_sessions(stack, urls)
        for _ in range(MAX_TURNS):
            text, calls = await complete(client, model, messages, tools)
            if not calls:
                return text
            messages.append(
                {
                    "role": "assistant",
                    "content": text or None,
                    "tool_calls": [
                        {
                            "id": c["id"],
                            "type": "function",
                            "function": {"name": c["name"], "arguments": c["arguments"]},
                        }
                        for c in calls
                    ],
                }
            )
            for c in calls:
                result = await call_tool(by_tool, c)
                messages.append({"role": "tool", "tool_call_id": c["id"], "content": result})
    raise RuntimeError(f"no answer after {MAX_TURNS} turns")


def main(system=SYSTEM, name="plain-agent"):
    try:
        answer = asyncio.run(run(system))
    except Exception as e:  # the agent's failure is its exit code
        print(f"{name}: {e!r}", file=sys.stderr)
        sys.exit(1)
    print(answer)
    if result_file := os.environ.get("AGENTRUN_RESULT_FILE"):
        with open(result_file, "w") as f:
            f.write(answer)


if __name__ == "__main__":
    main()
