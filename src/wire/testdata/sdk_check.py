"""Checks agentrun's served dialects with the providers' own Python SDKs.

Run by hand (see README.md): it loads every file under rendered/ through the
SDKs' models, serves them from a local HTTP server to the SDK clients (plain,
streaming and the stream helpers that accumulate a final object), runs real
agents (OpenAI Agents SDK with default settings, LangGraph's ReAct agent over
langchain-openai ChatOpenAI, plain and streaming, and the anthropic SDK in a
tool loop) against it, and writes the request bodies they sent to requests/.
Exits non-zero on the first failure.
"""

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

HERE = Path(__file__).resolve().parent
RENDERED = HERE / "rendered"
REQUESTS = HERE / "requests"
SCRIPT = []  # fixture names to answer with, in order
CAPTURED = []  # (path, body) of each request


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        CAPTURED.append((self.path, body))
        name = SCRIPT.pop(0)
        if name.startswith("error-"):
            status = int(name.split("-")[-1])
            kind = "anthropic" if self.path.endswith("/messages") else "openai"
            return self.send(status, "application/json", RENDERED / f"{kind}-error-{status}.json")
        if body.get("stream"):
            usage = (body.get("stream_options") or {}).get("include_usage")
            if self.path.endswith("/chat/completions") and not usage:
                name += "-nousage"
            return self.send(200, "text/event-stream", RENDERED / f"{name}.sse")
        self.send(200, "application/json", RENDERED / f"{name}.json")

    def send(self, status, ctype, path):
        data = path.read_bytes()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def serve(*names):
    assert not SCRIPT, f"unused answers: {SCRIPT}"
    SCRIPT.extend(names)
    CAPTURED.clear()


def keep(prefix):
    """Writes the captured request bodies as requests/<prefix>-<n>.json."""
    REQUESTS.mkdir(exist_ok=True)
    for i, (_, body) in enumerate(CAPTURED, 1):
        (REQUESTS / f"{prefix}-{i}.json").write_text(json.dumps(body, indent=2) + "\n")
    print(f"  kept {len(CAPTURED)} request(s) as requests/{prefix}-*.json")


def sse_data(path):
    for block in path.read_text().split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[len("data: "):])


def check_models():
    import pydantic
    from anthropic.types import Message, RawMessageStreamEvent
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    from openai.types.responses import Response, ResponseStreamEvent

    events = {
        "responses": pydantic.TypeAdapter(ResponseStreamEvent),
        "messages": pydantic.TypeAdapter(RawMessageStreamEvent),
    }
    objects = {"chat_completions": ChatCompletion, "responses": Response, "messages": Message}
    n = 0
    for path in sorted(RENDERED.iterdir()):
        dialect = path.name.split("-")[0]
        if path.suffix == ".json" and dialect in objects:
            objects[dialect].model_validate_json(path.read_text(), strict=False)
        elif path.suffix == ".sse":
            for data in sse_data(path):
                if dialect == "chat_completions":
                    ChatCompletionChunk.model_validate(data)
                else:
                    events[dialect].validate_python(data)
                n += 1
    print(f"models: every rendered object and {n} stream events validate")


def check_openai_clients(base):
    import openai

    c = openai.OpenAI(base_url=base, api_key="k", max_retries=0)
    msgs = [{"role": "user", "content": "refund 42"}]
    serve("chat_completions-both")
    r = c.chat.completions.create(model="m", messages=msgs)
    m = r.choices[0].message
    assert m.content == "Refunding 300 of order 42." and r.choices[0].finish_reason == "tool_calls"
    assert json.loads(m.tool_calls[0].function.arguments) == {"order": 42, "amount": 300}
    assert r.usage.total_tokens == 132
    serve("chat_completions-tools")
    with c.chat.completions.stream(model="m", messages=msgs, stream_options={"include_usage": True}) as s:
        final = s.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert [(t.id, t.function.name, json.loads(t.function.arguments)) for t in calls] == [
        ("call_a1", "lookup", {"order": 42}), ("call_b2", "lookup", {"order": 43})], calls
    assert final.usage.prompt_tokens == 120
    serve("chat_completions-text")
    chunks = list(c.chat.completions.create(model="m", messages=msgs, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "Order 42 was refunded."
    serve("chat_completions-limit")
    assert c.chat.completions.create(model="m", messages=msgs).choices[0].finish_reason == "length"
    print("openai chat completions: create, create(stream=True), stream() helper: ok")

    serve("responses-both")
    r = c.responses.create(model="m", input="refund 42")
    assert r.output_text == "Refunding 300 of order 42." and r.status == "completed"
    assert [(o.call_id, o.name) for o in r.output if o.type == "function_call"] == [("call_c3", "refund")]
    serve("responses-tools")
    with c.responses.stream(model="m", input="refund 42") as s:
        final = s.get_final_response()
    assert [(o.call_id, json.loads(o.arguments)) for o in final.output] == [
        ("call_a1", {"order": 42}), ("call_b2", {"order": 43})], final.output
    serve("responses-both")
    with c.responses.stream(model="m", input="refund 42") as s:
        assert s.get_final_response().output_text == "Refunding 300 of order 42."
    serve("responses-text")
    kinds = [e.type for e in c.responses.create(model="m", input="hi", stream=True)]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    serve("responses-limit")
    r = c.responses.create(model="m", input="hi")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    print("openai responses: create, create(stream=True), stream() helper: ok")

    tools = [{"type": "function", "function": {"name": "lookup", "description": "Find an order",
              "parameters": {"type": "object", "properties": {"order": {"type": "integer"}}}}}]
    serve("chat_completions-tools", "chat_completions-text")
    history = [{"role": "system", "content": "You are careful."},
               {"role": "user", "content": "What about orders 42 and 43?"}]
    m = c.chat.completions.create(model="m", messages=history, tools=tools).choices[0].message
    history.append(m)  # the SDK's own message object, as plain agents do
    for t in m.tool_calls:
        order = json.loads(t.function.arguments)["order"]
        history.append({"role": "tool", "tool_call_id": t.id, "content": lookup_impl(order)})
    s = c.chat.completions.create(model="m", messages=history, tools=tools, stream=True,
                                  stream_options={"include_usage": True})
    assert "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices) == "Order 42 was refunded."
    keep("openai_sdk")

    for status, error in [(400, openai.BadRequestError), (401, openai.AuthenticationError),
                          (429, openai.RateLimitError), (500, openai.InternalServerError)]:
        serve(f"error-{status}")
        try:
            c.chat.completions.create(model="m", messages=msgs)
            raise AssertionError("no error")
        except error as e:
            assert "image_url" in e.message, e.message
    print("openai errors: 400, 401, 429, 500 raise the SDK's own error classes with the message")


def check_anthropic_client(base):
    import anthropic

    c = anthropic.Anthropic(base_url=base, api_key="k", max_retries=0)
    msgs = [{"role": "user", "content": "refund 42"}]
    serve("messages-both")
    m = c.messages.create(model="m", max_tokens=100, messages=msgs)
    assert m.stop_reason == "tool_use" and m.content[0].text == "Refunding 300 of order 42."
    assert m.content[1].input == {"order": 42, "amount": 300}
    serve("messages-tools")
    with c.messages.stream(model="m", max_tokens=100, messages=msgs) as s:
        final = s.get_final_message()
    assert [(b.id, b.input) for b in final.content] == [("call_a1", {"order": 42}), ("call_b2", {"order": 43})]
    assert final.usage.input_tokens == 120 and final.usage.output_tokens == 12
    serve("messages-text")
    with c.messages.stream(model="m", max_tokens=100, messages=msgs) as s:
        assert "".join(s.text_stream) == "Order 42 was refunded."
    serve("messages-limit")
    kinds = [e.type for e in c.messages.create(model="m", max_tokens=5, messages=msgs, stream=True)]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    for status, error in [(400, anthropic.BadRequestError), (401, anthropic.AuthenticationError),
                          (429, anthropic.RateLimitError), (500, anthropic.InternalServerError)]:
        serve(f"error-{status}")
        try:
            c.messages.create(model="m", max_tokens=100, messages=msgs)
            raise AssertionError("no error")
        except error as e:
            assert "image_url" in e.message and e.body["error"]["type"], e.message
    print("anthropic messages: create, create(stream=True), stream() helper, errors: ok")

    tools = [{"name": "lookup", "description": "Find an order",
              "input_schema": {"type": "object", "properties": {"order": {"type": "integer"}}}}]
    serve("messages-tools", "messages-text")
    history = [{"role": "user", "content": "What about orders 42 and 43?"}]
    m = c.messages.create(model="m", max_tokens=1024, system="You are careful.", tools=tools,
                          messages=history)
    history.append({"role": "assistant", "content": m.content})
    history.append({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": b.id, "content": f"order {b.input['order']}: paid"}
        for b in m.content]})
    c.messages.create(model="m", max_tokens=1024, system="You are careful.", tools=tools,
                      messages=history)
    keep("anthropic_sdk")


def lookup_impl(order: int) -> str:
    return f"order {order}: paid"


def check_agents_sdk():
    from agents import Agent, Runner, function_tool

    @function_tool
    def lookup(order: int) -> str:
        """Find an order."""
        return lookup_impl(order)

    agent = Agent(name="clerk", instructions="You are careful.", tools=[lookup])
    serve("responses-tools", "responses-text")
    result = Runner.run_sync(agent, "What about orders 42 and 43?")
    assert result.final_output == "Order 42 was refunded.", result.final_output
    keep("agents_sdk")
    print("openai agents SDK (default settings, Responses): ok")

    import asyncio

    async def streamed():
        run = Runner.run_streamed(agent, "What about orders 42 and 43?")
        async for _ in run.stream_events():
            pass
        return run.final_output

    serve("responses-tools", "responses-text")
    assert asyncio.run(streamed()) == "Order 42 was refunded."
    keep("agents_sdk_streamed")
    print("openai agents SDK run_streamed: ok")


def check_langgraph():
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    @tool
    def lookup(order: int) -> str:
        """Find an order."""
        return lookup_impl(order)

    for streaming, prefix in [(False, "langgraph"), (True, "langgraph_streaming")]:
        model = ChatOpenAI(model="gpt-test", streaming=streaming)
        agent = create_react_agent(model, [lookup], prompt="You are careful.")
        serve("chat_completions-tools", "chat_completions-text")
        out = agent.invoke({"messages": [("user", "What about orders 42 and 43?")]})
        assert out["messages"][-1].content == "Order 42 was refunded.", out["messages"][-1]
        keep(prefix)
    print("langgraph create_react_agent over ChatOpenAI, plain and streaming: ok")


def main():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}"
    os.environ.update({"OPENAI_BASE_URL": base + "/v1", "OPENAI_API_KEY": "k",
                       "OPENAI_AGENTS_DISABLE_TRACING": "1"})
    check_models()
    check_openai_clients(base + "/v1")
    check_anthropic_client(base)
    check_agents_sdk()
    check_langgraph()
    assert not SCRIPT, SCRIPT
    print("all SDK checks passed")


if __name__ == "__main__":
    sys.exit(main())
