"""Tasks render their prompts with the model's chat template when the tokenizer has one.

Instruction models (the embedded Qwen2.5-Coder-0.5B-Instruct) answer a question put in a user turn
instead of continuing the text; the rendered prompt is what the item's fingerprint hashes, so results
with and without a template never mix on resume.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import processors

from kvhive.evaluation import read_results
from kvhive.evaluation.kvhive_backend import KVHiveBackend
from kvhive.evaluation.runner import run_eval
from kvhive.evaluation.tasks import get_task
from kvhive.evaluation.tasks.base import (
    Item,
    Task,
    apply_chat_template,
    render_chat_prompt,
)
from kvhive.models import tiny_model, tiny_tokenizer

# ChatML, the format of the Qwen models' template (reduced to what the tasks use).
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A template that starts with the BOS token, as Gemma's and Llama's do.
BOS_FIRST = "{{ bos_token }}" + CHATML


def templated_tokenizer(template: str = CHATML):
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = template
    return tokenizer


def bos_adding_tokenizer(template: str):
    """The tiny byte tokenizer, but putting <bos> first when encoding with special tokens."""
    tokenizer = templated_tokenizer(template)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tokenizer.bos_token} $A", special_tokens=[(tokenizer.bos_token, tokenizer.bos_token_id)]
    )
    assert tokenizer("a")["input_ids"] == [tokenizer.bos_token_id, ord("a")]
    return tokenizer


def test_render_puts_the_prompt_in_a_user_turn_and_opens_the_assistant_turn():
    rendered = render_chat_prompt(templated_tokenizer(), "What is 2 + 2?")
    assert rendered == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"


def test_render_opens_the_assistant_turn_with_the_answer_prefix():
    # Left in the user's turn, the prefix makes an instruction model repeat it instead of answering.
    prompt = "Some context.\n\nQuestion: What is best?\nAnswer: The best thing to do is"
    rendered = render_chat_prompt(templated_tokenizer(), prompt)
    assert rendered == (
        "<|im_start|>user\nSome context.\n\nQuestion: What is best?<|im_end|>\n"
        "<|im_start|>assistant\nThe best thing to do is"
    )


@pytest.mark.parametrize("prompt", ["Question: 1 + 1?\nAnswer:", "Summary:", "no cue at all", "Answer: on one line"])
def test_render_keeps_prompts_without_a_prefixed_cue_line_in_the_user_turn(prompt):
    rendered = render_chat_prompt(templated_tokenizer(), prompt)
    assert rendered == f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def test_render_drops_the_template_bos_when_the_tokenizer_adds_one():
    tokenizer = bos_adding_tokenizer(BOS_FIRST)
    rendered = render_chat_prompt(tokenizer, "hi")
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(rendered)["input_ids"]
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id


def test_render_keeps_the_template_bos_when_the_tokenizer_adds_none():
    tokenizer = templated_tokenizer(BOS_FIRST)
    rendered = render_chat_prompt(tokenizer, "hi")
    assert rendered.startswith(tokenizer.bos_token + "<|im_start|>user\nhi")
    assert tokenizer(rendered)["input_ids"].count(tokenizer.bos_token_id) == 1


def test_task_load_renders_prompts_and_records_the_template():
    task = get_task("synthetic_recall", num_pairs=4)
    plain = task.load(None, 2, 0, tiny_tokenizer())
    chat = task.load(None, 2, 0, templated_tokenizer())
    assert [item.id for item in chat] == [item.id for item in plain]
    for plain_item, chat_item in zip(plain, chat, strict=True):
        assert chat_item.prompt == render_chat_prompt(templated_tokenizer(), plain_item.prompt)
        # The answer cue's prefix opens the assistant's turn; the question stays in the user's.
        question, cue = plain_item.prompt.rsplit("\n", 1)
        prefix = cue.removeprefix("Answer: ")
        assert chat_item.prompt == f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{prefix}"
        assert chat_item.references == plain_item.references
        assert len(chat_item.metadata["chat_template"]) == 12
        assert "chat_template" not in plain_item.metadata
        # The fingerprint (item_hash in the results) tells the two apart.
        assert chat_item.fingerprint() != plain_item.fingerprint()
    other_template = task.load(None, 2, 0, templated_tokenizer(CHATML.replace("<|im_start|>", "<|turn|>")))
    assert other_template[0].fingerprint() != chat[0].fingerprint()
    assert other_template[0].metadata["chat_template"] != chat[0].metadata["chat_template"]


def test_tokenizer_without_template_leaves_items_unchanged():
    items = [Item(id="a", prompt="text", references=["x"], max_new_tokens=2)]
    assert apply_chat_template(items, "generate", tiny_tokenizer()) is items


class _StreamTask(Task):
    """A task defined after the base class: its own ``load`` gets the template step too."""

    name = "stream_for_test"
    kind = "perplexity"

    def load(self, data_dir, limit, seed, tokenizer):
        return [Item(id="s", prompt="not rendered", token_ids=[1, 2, 3])]


class _ChoiceTask(_StreamTask):
    name = "choice_for_test"
    kind = "choice"

    def load(self, data_dir, limit, seed, tokenizer):
        return [Item(id="c", prompt="Question: 1 + 1?\nAnswer:", choices=[" 2", " 3"], label=0)]


def test_perplexity_items_are_token_streams_and_are_not_rendered():
    (item,) = _StreamTask().load(None, None, 0, templated_tokenizer())
    assert item.prompt == "not rendered" and "chat_template" not in item.metadata


def test_choice_contexts_are_rendered():
    (item,) = _ChoiceTask().load(None, None, 0, templated_tokenizer())
    assert item.prompt == "<|im_start|>user\nQuestion: 1 + 1?\nAnswer:<|im_end|>\n<|im_start|>assistant\n"
    assert item.choices == [" 2", " 3"]


@pytest.mark.parametrize("template", [None, CHATML])
def test_the_model_sees_the_rendered_prompt_and_results_record_its_hash(tmp_path: Path, template):
    tokenizer = tiny_tokenizer() if template is None else templated_tokenizer(template)
    backend = KVHiveBackend(tiny_model("llama"), tokenizer, model_name="tiny-llama-gqa")
    seen: list[str] = []
    generate = backend.generate
    backend.generate = lambda prompt, *args: seen.append(prompt) or generate(prompt, *args)
    run_eval(backend, ["synthetic_recall:num_pairs=3:max_new_tokens=2"], [], [0.5], 1, None, tmp_path, progress=False)

    (record,) = read_results(tmp_path)
    (expected,) = get_task("synthetic_recall", num_pairs=3, max_new_tokens=2).load(None, 1, 0, tokenizer)
    assert seen == [expected.prompt]
    assert record["item_hash"] == expected.fingerprint()
    assert record["metadata"].get("chat_template") == expected.metadata.get("chat_template")
    assert (template is None) == ("<|im_start|>" not in seen[0])


def test_a_rendered_prompt_keeps_its_question_as_its_final_part():
    # The question (Item.question) runs from its first line to the rendered prompt's end: the
    # template closes the user's turn after it and opens the assistant's with the answer prefix.
    task = get_task("needle", lengths=[200], depths=[50], max_new_tokens=4)
    from kvhive.evaluation.cli import default_data_dir

    plain = task.load(default_data_dir(), 1, 0, tiny_tokenizer())[0]
    chat = task.load(default_data_dir(), 1, 0, templated_tokenizer())[0]
    assert plain.prompt.endswith(plain.question) and plain.question.startswith("\n\nQuestion:")
    assert chat.prompt.endswith(chat.question) and chat.question.startswith("\n\nQuestion:")
    assert chat.question.endswith("<|im_start|>assistant\nThe best thing to do in San Francisco is")
