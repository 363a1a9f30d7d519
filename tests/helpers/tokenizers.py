"""A tiny Hugging Face tokenizer made here (trained BPE + a chat template), no hub download."""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé text: naïve café, Straße, smörgåsbord.",
    "日本語のテキストと中文文本。",
    "emoji 🙂🚀 and math ∑ ∫ √",
    "def hello(world): return world * 2",
] * 20

# ChatML with a system default, loop variables, raise_exception and tojson: the features
# templates of real checkpoints (Qwen2, Llama 3) use.
CHAT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}{{ bos_token }}<|im_start|>system\n"
    "You are helpful.<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% if loop.last and message.get('meta') %}{{ message['meta'] | tojson }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer_dir(path: str, vocab_size: int = 400) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "chat_template": CHAT_TEMPLATE, "model_max_length": 2048}
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return path
