"""Chat-template prefix stability with real tokenizers: an episode's token stream, built turn by turn
without re-tokenizing what the engine saw, is exactly the template's rendering of the conversation.
Tokenizers: the tiny character one, SmolLM2's (ChatML), and SmolLM2's vocabulary under a Qwen2-style
template written here (tools in the system turn, tool results grouped in one user turn)."""

from __future__ import annotations

import pytest

from raygraph.agents.episode import AgentBudgets
from raygraph.agents.loop import AgentLoop
from raygraph.agents.turns import TurnTemplate
from raygraph.data.chat import format_prompt
from raygraph.models.tiny import build_tiny_tokenizer

QWEN2_STYLE = (   # HF renders with trim_blocks: newlines are written as expressions
    "{% if tools %}{{ '<|im_start|>system\\nYou may call tools:' }}{% for t in tools %}{{ '\\n' + (t | tojson) }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}"
    "{% if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


class Replay:
    """An engine that 'generates' fixed texts (their canonical tokens + eos), one turn per poll."""
    lock_step = False

    def __init__(self, tokenizer, turns):
        self.tok, self.turns, self.queue, self.k = tokenizer, turns, [], 0

    def submit(self, key, prompt, max_tokens, seed):
        self.queue.append(key)

    def pending(self):
        return len(self.queue)

    def abort(self):
        self.queue = []

    def poll(self):
        key = self.queue.pop(0)
        tokens = self.tok(self.turns[self.k], add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        self.k += 1
        return [(key, tokens, [0.0] * len(tokens))]


class Echo:
    """Observation after each turn, done after three turns."""

    def __init__(self, row):
        self.k = 0

    def step(self, response):
        self.k += 1
        return f"observation {self.k}", 0.0, self.k >= 3


def _closing_text(tokenizer, kwargs: dict) -> str:
    """What the template writes after a final assistant turn (its end of turn), e.g. `<|im_end|>\\n`."""
    full = tokenizer.apply_chat_template([{"role": "user", "content": "U"}, {"role": "assistant", "content": "MARK"}],
                                         tokenize=False, add_generation_prompt=False, **kwargs)
    return full[full.index("MARK") + len("MARK"):]


def _run_episode(tokenizer, tools=(), tool_role="tool", template_kwargs=None):
    """Three replayed turns with an observation after the first two: (episode, prompt ids,
    conversation as messages, template kwargs)."""
    from raygraph.agents.env import register_env

    register_env("test_turns_echo", Echo)
    template_kwargs = dict(template_kwargs or {})
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    turns = ["Let me think", "It is 42", "42"]
    loop = AgentLoop(tokenizer=tokenizer, stop_token_ids=[tokenizer.eos_token_id], env="test_turns_echo",
                     tools=list(tools), tool_role=tool_role, chat_template_kwargs=template_kwargs,
                     budgets=AgentBudgets(max_turns=3, max_new_tokens=64, max_total_tokens=2048, max_message_tokens=64))
    kwargs = {**template_kwargs, **({"tools": loop.reactor.toolbox.schemas} if tools else {})}
    prompt_text = format_prompt(tokenizer, messages, True, kwargs)
    prompt = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    (ep,) = loop.run(Replay(tokenizer, turns), [prompt], [{"uid": 0}], [0])
    conversation = messages + [m for k, text in enumerate(turns) for m in (
        {"role": "assistant", "content": text}, *([{"role": "user", "content": f"observation {k + 1}"}] if k < 2 else []))]
    return ep, prompt, conversation, kwargs


def _episode_matches_template(tokenizer, tools=(), tool_role="tool", template_kwargs=None):
    ep, prompt, conversation, kwargs = _run_episode(tokenizer, tools, tool_role, template_kwargs)
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)
    # the stream is the rendering; only after the last turn the template writes its end of turn
    # (or, like the tiny one, nothing) where the model wrote its eos
    assert ep.tokens[-1] == tokenizer.eos_token_id
    streamed = tokenizer.decode(prompt + ep.tokens[:-1])
    assert rendered.startswith(streamed), (rendered, streamed)
    assert rendered[len(streamed):] == _closing_text(tokenizer, kwargs)
    return ep


def test_a_template_that_rewrites_history_does_not_change_the_trained_stream():
    # this template upper-cases earlier assistant turns (as templates that drop past reasoning change them)
    tok = build_tiny_tokenizer()
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>"
                         "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'] | upper }}"
                         "{% else %}{{ m['content'] }}{% endif %}"
                         "<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    ep, prompt, conversation, _ = _run_episode(tok)
    assert "LET ME THINK" in tok.apply_chat_template(conversation, tokenize=False)
    assert tok.decode(prompt + ep.tokens) == (
        "<|user|>What is 12 + 30?<|end|><|assistant|>Let me think<|end|><|user|>observation 1<|end|><|assistant|>"
        "It is 42<|end|><|user|>observation 2<|end|><|assistant|>42<|end|>")
    assert [t for t, m in zip(ep.tokens, ep.mask) if m] == tok("Let me think<|end|>It is 42<|end|>42<|end|>",
                                                              add_special_tokens=False)["input_ids"]


def test_a_template_that_hides_past_turns_is_refused_before_any_episode():
    tok = build_tiny_tokenizer()
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>"
                         "{% if m['role'] == 'assistant' and not loop.last %}x{% else %}{{ m['content'] }}{% endif %}"
                         "<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    with pytest.raises(ValueError, match="does not show an assistant turn's text once more messages follow"):
        TurnTemplate(tok, stop_token_ids=[tok.eos_token_id])


def test_tiny_template_stream_equals_the_rendered_conversation():
    _episode_matches_template(build_tiny_tokenizer())


def test_smollm2_template_stream_equals_the_rendered_conversation(smollm2_tokenizer):
    ep = _episode_matches_template(smollm2_tokenizer)
    assert ep.mask.count(1) == sum(len(smollm2_tokenizer(t, add_special_tokens=False)["input_ids"]) + 1
                                   for t in ["Let me think", "It is 42", "42"])


def test_qwen2_style_template_groups_tool_results_and_stays_a_prefix(smollm2_tokenizer, tmp_path):
    tok = smollm2_tokenizer.__class__.from_pretrained(smollm2_tokenizer.name_or_path)
    tok.chat_template = QWEN2_STYLE
    tools = tmp_path / "calc.py"
    tools.write_text('def add(a: int, b: int) -> int:\n    """Add two integers.\n\n    Args:\n        a: first\n'
                     '        b: second\n    """\n    return a + b\n')
    template = TurnTemplate(tok, stop_token_ids=[tok.eos_token_id])
    # two tool results after one turn: one user block, each in its own <tool_response>
    text = template.appended_text([{"role": "tool", "content": "5"}, {"role": "tool", "content": "7"}], tok.eos_token_id)
    assert text == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n7\n</tool_response>" \
                   "<|im_end|>\n<|im_start|>assistant\n"
    _episode_matches_template(tok, tools=[f"{tools}:add"])
