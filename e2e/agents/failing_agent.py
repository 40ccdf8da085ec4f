"""An agent that gives up: it asks its model once (the openai SDK, as
plain_agent does), then says why on stderr and exits 3, as a program does
when something it needs is missing. For agentrun a non-zero exit is a
crash: the retry policy counts it, and the run's error quotes these words."""

import asyncio
import os
import sys

from openai import AsyncOpenAI

import plain_agent


async def ask():
    messages = [
        {"role": "system", "content": plain_agent.SYSTEM},
        {"role": "user", "content": os.environ["AGENTRUN_INPUT"]},
    ]
    model = os.environ.get("MODEL", "gpt-4o-mini")
    text, _ = await plain_agent.complete(AsyncOpenAI(), model, messages, [])
    return text


if __name__ == "__main__":
    said = asyncio.run(ask())
    print(f"failing-agent: cannot go on: {said}", file=sys.stderr)
    sys.exit(3)
