"""What the README's Hugging Face snippet takes as given (its ``setup`` marker, tests/snippets.py):
imports, the process group and a mesh on 2 processes (torchrun --nproc-per-node 2), a model
``name`` that ``from_pretrained`` loads without a download (a small random Llama, saved in the
working folder) and tokenized ``examples``."""

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: F401  (the snippet's)
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, LlamaConfig  # noqa: F401

import hcp_compile

dist.init_process_group("gloo")
mesh = hcp_compile.make_mesh(ulysses=2, ring=1, device_type="cpu")
torch.manual_seed(0)  # the same weights on every rank
config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
name = "tiny-llama"
if dist.get_rank() == 0:  # under torch.distributed, save_pretrained writes on the main rank only
    AutoModelForCausalLM.from_config(config).save_pretrained(name)
dist.barrier()  # no rank loads the model before it is written
examples = [{"input_ids": list(range(1, length))} for length in (9, 4, 13)]
