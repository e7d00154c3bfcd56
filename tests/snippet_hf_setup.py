"""What the README's Hugging Face snippet reads from its environment in the suite (its ``setup``
marker, tests/snippets.py): ``MODEL``, a folder that ``from_pretrained`` loads without a
download (a small random Llama and a character tokenizer, saved in the working folder). Each
rank writes its own copy (the same weights), so that no rank waits for another before the
snippet starts."""

import os

import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

chars = "abcdefghijklmnopqrstuvwxyz ."
tokenizer = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "<unk>": 2,
                                        **{c: i + 3 for i, c in enumerate(chars)}}, unk_token="<unk>"))
tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
name = f"tiny-llama-rank{os.environ['RANK']}"
PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                        unk_token="<unk>").save_pretrained(name)
torch.manual_seed(0)  # the same weights on every rank
config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=len(chars) + 3, pad_token_id=0, eos_token_id=1,
                     bos_token_id=None)
AutoModelForCausalLM.from_config(config).save_pretrained(name)
os.environ["MODEL"] = name
