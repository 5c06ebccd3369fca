"""data.chat_template_kwargs: extra variables of the chat template (e.g. Qwen3's enable_thinking)
reach every prompt the run formats."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from raygraph.config import ConfigError, load_config
from raygraph.data.chat import format_prompt
from raygraph.data.prompts import PromptDataset
from raygraph.data.toy import write_toy_dataset

TOY = Path(__file__).resolve().parents[2] / "configs" / "grpo_toy.yaml"
# a template in the style of Qwen3's: the generation prompt is closed early when thinking is off
TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}nothink{% endif %}=")


@pytest.fixture
def thinking_tokenizer(char_tokenizer):
    tokenizer = copy.deepcopy(char_tokenizer)
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def test_template_variables_change_the_rendered_prompt(thinking_tokenizer):
    messages = [{"role": "user", "content": "3+4"}]
    assert format_prompt(thinking_tokenizer, messages) == "3+4="
    assert format_prompt(thinking_tokenizer, messages, chat_template_kwargs={"enable_thinking": False}) == "3+4nothink="


def test_prompt_dataset_and_the_run_feed_use_them(thinking_tokenizer, tmp_path):
    from raygraph.run.feed import StepData

    write_toy_dataset(tmp_path / "data", n_train=8, n_val=4)
    dataset = PromptDataset(tmp_path / "data" / "train.parquet", thinking_tokenizer, max_prompt_length=64,
                            chat_template_kwargs={"enable_thinking": False})
    assert len(dataset) == 8 and all(row.prompt_text.endswith("nothink=") for row in dataset.rows)
    assert thinking_tokenizer.decode(dataset[0].prompt_ids).endswith("nothink=")

    thinking_tokenizer.save_pretrained(tmp_path / "tok")
    cfg = load_config(TOY, [f"model.tokenizer_path={tmp_path / 'tok'}", f"data.train_files=[{tmp_path}/data/train.parquet]",
                            f"data.val_files=[{tmp_path}/data/val.parquet]", "data.toy=null",
                            "data.chat_template_kwargs.enable_thinking=false"])
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}
    val = StepData.load(cfg).val_prompts
    texts = thinking_tokenizer.batch_decode(val["prompt_ids"], skip_special_tokens=True)
    assert texts and all(t.endswith("nothink=") for t in texts), texts


def test_template_variables_without_a_template_are_an_error():
    with pytest.raises(ConfigError, match="data.chat_template_kwargs is set but data.apply_chat_template is false"):
        load_config(TOY, ["data.apply_chat_template=false", "data.chat_template_kwargs={enable_thinking: false}"])
