"""An OpenAI Agents SDK agent with default settings, its tools from MCP servers.

Configured only by its environment: the task in AGENTRUN_INPUT, the MCP
servers' URLs in MCP_URLS (comma-separated), the model in MODEL (default
gpt-4o-mini); the SDK reads OPENAI_BASE_URL and OPENAI_API_KEY itself.
Prints its answer and writes it to $AGENTRUN_RESULT_FILE when set.
"""

import asyncio
import os
import sys
from contextlib import AsyncExitStack

from agents import Agent, Runner
from agents.mcp import MCPServerStreamableHttp


async def main():
    urls = [u.strip() for u in os.environ.get("MCP_URLS", "").split(",") if u.strip()]
    async with AsyncExitStack() as stack:
        servers = [
            await stack.enter_async_context(
                MCPServerStreamableHttp(name=f"tools-{i}", params={"url": url})
            )
            for i, url in enumerate(urls)
        ]
        agent = Agent(
            name="Assistant",
            instructions="You are a helpful assistant. Use the tools when they help.",
            model=os.environ.get("MODEL", "gpt-4o-mini"),
            mcp_servers=servers,
        )
        result = await Runner.run(agent, os.environ["AGENTRUN_INPUT"])
    answer = str(result.final_output)
    print(answer)
    if result_file := os.environ.get("AGENTRUN_RESULT_FILE"):
        with open(result_file, "w") as f:
            f.write(answer)


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except Exception as e:  # the agent's failure is its exit code
        print(f"agents-sdk-agent: {e!r}", file=sys.stderr)
        sys.exit(1)
