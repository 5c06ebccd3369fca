"""Agent programs of tests/agents/test_program.py (loaded as `programs.py:<name>`, as a user's file)."""

from __future__ import annotations

import asyncio

import httpx


async def two_turns(row, client, feedback: str = "again"):
    """Asks, then asks again with its answer and `feedback` appended: the second call extends the first."""
    messages = list(row["prompt"])
    first = await client.chat.completions.create(model="policy", messages=messages, logprobs=True)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": feedback}]
    second = await client.chat.completions.create(model="policy", messages=messages)
    return {"reward": float(len(second.choices[0].message.content)), "first": first.model_dump()}


async def rewritten_history(row, client):
    """The second call drops the first exchange and asks something else: a new row."""
    await client.chat.completions.create(model="policy", messages=list(row["prompt"]))
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "other"}])
    return 2.0


async def asks_for(row, client, **params):
    """One call with `params`; the reward is 1 when it was served, else the error's status / 1000."""
    import openai

    try:
        await client.chat.completions.create(model="policy", messages=list(row["prompt"]), **params)
    except openai.APIStatusError as exc:
        return {"reward": exc.status_code / 1000, "error": str(exc)}
    return 1.0


async def many_calls(row, client, calls: int = 5):
    """`calls` calls, each with a fresh one-message prompt; the refusal past max_turns is caught."""
    import openai

    done = 0
    for _ in range(calls):
        try:
            await client.completions.create(model="policy", prompt="12+", max_tokens=100)
            done += 1
        except openai.BadRequestError:
            break
    return float(done)


async def hangs_after_one_call(row, client):
    """One call, then waits forever when the row says so (extra_info.hang)."""
    await client.chat.completions.create(model="policy", messages=list(row["prompt"]))
    if row["extra_info"].get("hang"):
        await asyncio.sleep(3600)
    return 1.0


async def raises(row, client):
    raise RuntimeError("the agent broke")


async def returns_text(row, client):
    return "fine"


async def plain_http(row, client):
    """No openai calls: raw HTTP with the client's address and key (and one request without the key)."""
    url = f"{client.base_url}".rstrip("/") + "/chat/completions"
    body = {"model": "policy", "messages": list(row["prompt"])}
    async with httpx.AsyncClient() as http:
        anonymous = await http.post(url, json=body)
        served = await http.post(url, json=body, headers={"Authorization": f"Bearer {client.api_key}"})
    return {"reward": float(len(served.json()["raygraph"]["completion_token_ids"])),
            "statuses": (anonymous.status_code, served.status_code)}


async def no_call(row, client):
    """Never calls the model."""
    return 3.0


CALCULATOR = {"type": "function", "function": {"name": "calculator", "description": "Evaluates arithmetic.",
                                               "parameters": {"type": "object", "properties": {
                                                   "expression": {"type": "string"}}, "required": ["expression"]}}}


async def uses_a_tool(row, client):
    """Offers the calculator; runs the call the model makes; asks again with its result."""
    from raygraph.agents.calculator import calculator

    messages = list(row["prompt"])
    reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
    message = reply.choices[0].message
    first = reply.model_dump()
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls or []:
        import json

        result = calculator(**json.loads(call.function.arguments))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
    return {"reward": 1.0 if reply.choices[0].message.content.strip() == "5" else 0.0, "first": first}


async def overflows(row, client):
    """Asks with a prompt past the context budget and does not catch the 400."""
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "9" * 200}])
    return 1.0


async def appends_to_its_row(row, client):
    """Mutates its row's messages (siblings of the same prompt must not see it)."""
    row["prompt"].append({"role": "user", "content": "mine"})
    await client.chat.completions.create(model="policy", messages=row["prompt"])
    return float(len(row["prompt"]))
