"""A Hugging Face Llama as your own model: ``fsdp2lab train --model examples/hf_llama.py:build``.

A small ``LlamaForCausalLM`` over bytes (vocabulary 256, ``--dataset text --vocab-size 256``),
built from its config (nothing downloaded). It is sharded per ``LlamaDecoderLayer`` (the repeated
block), and its config goes into checkpoints, so ``fsdp2lab ckpt export CKPT OUT_DIR`` writes a
folder that ``LlamaForCausalLM.from_pretrained(OUT_DIR)`` loads.
"""

from transformers import LlamaConfig, LlamaForCausalLM


def build(hidden=64, layers=2, heads=4, vocab=256, tied=True, max_len=1024):
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_len,  # at least --seq-len
        tie_word_embeddings=tied,
        attention_dropout=0.0,  # --dropout does not reach a Hugging Face model
        attn_implementation="eager",  # the same numbers on every device and batch split
    )
    return LlamaForCausalLM(config)
