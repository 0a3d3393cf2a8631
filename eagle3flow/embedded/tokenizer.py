"""A Llama-3-style byte-level BPE tokenizer with a chat template, trained offline.

Special tokens and the chat format follow Llama 3, so code written for a real
Llama-3 target works unchanged on the embedded one:

    <|begin_of_text|><|start_header_id|>user<|end_header_id|>\\n\\nHi<|eot_id|>
    <|start_header_id|>assistant<|end_header_id|>\\n\\nHello<|eot_id|>

As in Llama 3, ``tokenizer(text)`` prepends ``<|begin_of_text|>`` while
``apply_chat_template`` (whose text already starts with it) does not add a second
one. The assistant part of each turn, including ``<|eot_id|>``, is wrapped in
``{% generation %}`` so ``return_assistant_tokens_mask=True`` gives the loss mask.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

BOS = "<|begin_of_text|>"
EOS_TEXT = "<|end_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS_TEXT, START_HEADER, END_HEADER, EOT, PAD)  # ids 0..5

CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('Only system, user and assistant roles are supported, got ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}"
    "{%- else %}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)


def _training_texts(conversations: list[dict]):
    # The header strings are special tokens, so BPE only needs the message text
    # plus the role names and the blank line that follow a header.
    yield "system\n\nuser\n\nassistant\n\n"
    for conv in conversations:
        for message in conv["messages"]:
            yield message["content"]


def train_tokenizer(conversations: list[dict], vocab_size: int = 4096):
    """A ``PreTrainedTokenizerFast`` (vocab ``vocab_size`` incl. specials) fit on the corpus."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        # All 256 bytes up front: any text (any language, any emoji) stays encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_training_texts(conversations), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOT, pad_token=PAD,
        model_max_length=2048, padding_side="right", clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tokenizer(tokenizer, out_dir: Path) -> None:
    """Save with ``chat_template`` inside ``tokenizer_config.json`` (the documented contract)."""
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    # transformers 5 writes its own class name, unknown to transformers 4 (SGLang's);
    # the classic name loads as the same fast tokenizer in both.
    config_path = Path(out_dir) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.pop("backend", None)
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def special_token_ids(tokenizer) -> dict[str, int]:
    return {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
