"""Random Llama targets and chat tokenizers for tests, made offline in seconds.

:func:`make_random_llama` is the session's ``random_llama_target`` (tests/conftest.py) at
its defaults. :func:`make_chat_tokenizer` is a tiny byte-level BPE with a model family's
special tokens and official chat template (tests/fixtures/chat_templates);
:func:`make_chat_target` is the random Llama with a chat tokenizer beside it.
"""
from __future__ import annotations

from pathlib import Path

TEMPLATES = Path(__file__).resolve().parent.parent / "fixtures" / "chat_templates"


def make_random_llama(out_dir: Path, num_layers: int = 8, hidden_size: int = 64,
                      vocab_size: int = 512, heads: int = 2, kv_heads: int = 1,
                      intermediate_size: int = 128, tie_word_embeddings: bool = False,
                      seed: int = 0) -> Path:
    # head_dim = hidden_size // heads = 32: vLLM's CPU attention needs 32, 64, 80, ...
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=512, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config).to(torch.float32)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    return out_dir


# ----------------------------------------------------------------------------- chat tokenizers

DEEPSEEK_TOOL_TOKENS = ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                        "<｜tool▁call▁end｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
                        "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>", "<｜tool▁sep｜>"]
# family -> (special tokens, non-special added tokens, bos, eos, end-of-turn marker)
FAMILIES = {
    "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"], [],
               "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>"),
    "qwen3": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
              ["<think>", "</think>", "<tool_call>", "</tool_call>"],
              None, "<|im_end|>", "<|im_end|>"),
    "deepseek_v3": (["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                     *DEEPSEEK_TOOL_TOKENS], [],
                    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "kimi_k2": (["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                 "<|im_middle|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                 "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"], [],
                "[BOS]", "[EOS]", "<|im_end|>"),
}

CONVERSATION = [
    {"role": "system", "content": "You are a terse geography tutor."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital of France."},
    {"role": "user", "content": "Say exactly: hello world"},
    {"role": "assistant", "content": "hello world"},
    {"role": "user", "content": "And the capital of Italy?"},
    {"role": "assistant", "content": "Rome."},
]
CORPUS = [m["content"] for m in CONVERSATION] + [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Once upon a time in a forest there was a story about numbers one two three.",
    "You are a helpful assistant. Cutting Knowledge Date: December 2023 Today Date: 26 Jul 2024",
]


def make_chat_tokenizer(out_dir: Path, family: str, template: str | None = None) -> Path:
    """A byte-level BPE (vocab ~400) with ``family``'s special tokens and chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special, plain, bos, eos, _ = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = template if template is not None else \
        (TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8")
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return out_dir


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def save_bpe_chat_tokenizer(out_dir: Path, texts: list[str], vocab_size: int) -> None:
    """A byte-level BPE tokenizer trained on ``texts``, with the chat template, saved in ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False,
        special_tokens=["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>", chat_template=CHAT_TEMPLATE).save_pretrained(out_dir)


def make_chat_target(out_dir: Path, family: str | None = None) -> Path:
    """A random Llama vLLM's CPU attention accepts (head_dim 32; the weights of
    ``random_llama_target``) with a chat tokenizer beside it, all built offline: ``family``'s
    (:func:`make_chat_tokenizer`), or by default a BPE fit on a few sentences with
    :data:`CHAT_TEMPLATE`."""
    make_random_llama(out_dir, heads=2, kv_heads=1)
    if family is not None:
        make_chat_tokenizer(out_dir, family)
        return out_dir
    corpus = [f"the quick brown fox {i} jumps over the lazy dog" for i in range(100)]
    save_bpe_chat_tokenizer(out_dir, corpus * 2 + ["hello world, how are you today?"] * 20, 512)
    return out_dir


REMOTE_TOKENIZER_CODE = '''from transformers import PreTrainedTokenizerFast


class RemoteChatTokenizer(PreTrainedTokenizerFast):
    """A tokenizer class only this directory defines (as Kimi-K2.5 ships its own)."""

    remote_marker = "loaded from the target's own code"
'''


def add_remote_tokenizer_code(target_dir: Path) -> Path:
    """Make ``target_dir``'s tokenizer one that only its own code loads: a
    ``tokenization_remote.py`` beside it, named by ``auto_map`` and ``tokenizer_class`` in
    ``tokenizer_config.json`` (transformers runs it only with ``trust_remote_code=True``)."""
    import json

    target_dir = Path(target_dir)
    (target_dir / "tokenization_remote.py").write_text(REMOTE_TOKENIZER_CODE)
    config_file = target_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "RemoteChatTokenizer"
    config["auto_map"] = {"AutoTokenizer": [None, "tokenization_remote.RemoteChatTokenizer"]}
    config_file.write_text(json.dumps(config, indent=2))
    return target_dir
