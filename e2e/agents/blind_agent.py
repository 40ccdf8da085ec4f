"""plain_agent sending what a careless agent sends: first a request over
any sane size (what it is told comes back to its model as a note), then
every tool call its model proposes, to its first MCP server, whether that
server lists the tool or not. What the runner answers to bad input reaches
the model, as the SDKs raise or return it."""

import asyncio
import json
import os

import openai
from mcp.shared.exceptions import McpError

import plain_agent

# Over the runner's limit on a model request's body.
OVERSIZED_BYTES = 9 * 1024 * 1024


async def oversized_note():
    """What the runner answers to an oversized request, as the SDK raises it."""
    client = openai.AsyncOpenAI(max_retries=0)
    messages = [{"role": "user", "content": "x" * OVERSIZED_BYTES}]
    try:
        await client.chat.completions.create(model="gpt-4o-mini", messages=messages)
    except openai.APIStatusError as e:
        return f"(an oversized request got {e.status_code}: {e.message})"
    return "(an oversized request was answered)"


async def call_blindly(by_tool, call):
    """The call sent as the model proposed it; an error as the model should see it."""
    session = by_tool.get(call["name"]) or next(iter(by_tool.values()))
    try:
        result = await session.call_tool(call["name"], json.loads(call["arguments"] or "{}"))
    except McpError as e:
        return f"error: {e.error.message}"
    text = "\n".join(c.text for c in result.content if getattr(c, "text", None) is not None)
    return f"error: {text}" if result.isError else text


if __name__ == "__main__":
    note = asyncio.run(oversized_note())
    os.environ["AGENTRUN_INPUT"] = f"{os.environ['AGENTRUN_INPUT']} {note}"
    plain_agent.call_tool = call_blindly
    plain_agent.main(name="blind-agent")
