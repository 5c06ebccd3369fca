"""Multi-turn agent RL (`rollout.agent`, docs/agents.md): episodes of model turns, tools and
environment steps, run concurrently over a rollout engine.

    env.py           the environment contract: loading (name or file.py:Class), env_args, step results
    builtin_envs.py  the environments that ship (retry_with_feedback, reveal_then_answer, tool_answer)
    tools.py         tools: schemas, the tool-call parsers (hermes), running calls into tool messages
    sandbox.py       python_exec: a process per call with limits and no network
    turns.py         the tokens that follow a model turn, from the chat template (token-in, token-out)
    episode.py       one episode's tokens, masks, log-probs, rewards, budgets and truncation reason
    loop.py          AgentLoop: many episodes at once over a TurnEngine (the engines adapt in
                     raygraph.workers.agent_rollout)
"""
