"""LangGraph's prebuilt ReAct agent, its tools from MCP servers.

Configured only by its environment: the task in AGENTRUN_INPUT, the MCP
servers' URLs in MCP_URLS (comma-separated), the model in MODEL (default
gpt-4o-mini); ChatOpenAI reads OPENAI_BASE_URL and OPENAI_API_KEY itself.
Prints its answer and writes it to $AGENTRUN_RESULT_FILE when set.
"""

import asyncio
import os
import sys
from urllib.parse import urlparse

from langchain_mcp_adapters.client import MultiServerMCPClient
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent


def connections(urls):
    """One streamable HTTP connection per URL, named by its last path part."""
    named = {}
    for url in filter(None, (u.strip() for u in urls.split(","))):
        name = urlparse(url).path.rstrip("/").rsplit("/", 1)[-1] or "tools"
        while name in named:
            name += "_"
        named[name] = {"url": url, "transport": "streamable_http"}
    return named


async def main():
    client = MultiServerMCPClient(connections(os.environ.get("MCP_URLS", "")))
    tools = await client.get_tools()
    model = ChatOpenAI(model=os.environ.get("MODEL", "gpt-4o-mini"))
    agent = create_react_agent(model, tools)
    state = await agent.ainvoke(
        {"messages": [{"role": "user", "content": os.environ["AGENTRUN_INPUT"]}]}
    )
    answer = state["messages"][-1].content
    print(answer)
    if result_file := os.environ.get("AGENTRUN_RESULT_FILE"):
        with open(result_file, "w") as f:
            f.write(answer)


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except Exception as e:  # the agent's failure is its exit code
        print(f"langgraph-agent: {e!r}", file=sys.stderr)
        sys.exit(1)
