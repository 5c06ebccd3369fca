"""The multi-turn demo's task (`configs/demo_multiturn.yaml`, environment `retry_with_feedback`)
written as an agent program against an OpenAI-style client (`configs/demo_program.yaml`,
docs/agents.md "Agent programs"): the same rewards, reached through the endpoint instead of an
environment class. It uses nothing of raygraph; any agent code that talks to
`client.chat.completions` trains the same way.
"""

from __future__ import annotations

__all__ = ["run"]


async def run(row: dict, client, retry_reward: float = 0.5) -> dict:
    """1 for a right first answer; after a wrong one, the answer as feedback (`"7="`) and one more
    try, worth `retry_reward` when right."""
    answer = str(row["reward_model"]["ground_truth"]).strip()
    messages = list(row["prompt"])
    reply = await client.chat.completions.create(model="policy", messages=messages)
    first = reply.choices[0].message.content
    if first.strip() == answer:
        return {"reward": 1.0, "retried": 0}
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": f"{answer}="}]
    reply = await client.chat.completions.create(model="policy", messages=messages)
    return {"reward": retry_reward if reply.choices[0].message.content.strip() == answer else 0.0, "retried": 1}
