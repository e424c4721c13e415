"""A tiny random-weight Llama with a small trained byte-level BPE tokenizer and a ChatML template (for serving tests)."""
from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _corpus() -> list[str]:
    import pydoc_data.topics as topics

    return [t for t in topics.topics.values()][:200]


def save_tiny_chat_model(path: str | Path, seed: int = 0, generation_config: dict | None = None,
                         never_eos: bool = False, max_position_embeddings: int = 512,
                         hidden_size: int = 64, num_hidden_layers: int = 2) -> Path:
    """Save the model and tokenizer to ``path``; ``never_eos``: its eos logit is always 0 (a zero ``lm_head``
    row), so greedy decoding never ends a reply early (the other 500+ random logits always hold a larger one);
    ``hidden_size``/``num_hidden_layers``: a larger model streams more slowly (the MLP is twice as wide)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    path = Path(path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>",
                                     pad_token="</s>", clean_up_tokenization_spaces=False)
    hf_tok.chat_template = CHAT_TEMPLATE
    cfg = LlamaConfig(vocab_size=len(hf_tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_hidden_layers=num_hidden_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
                      bos_token_id=hf_tok.bos_token_id, eos_token_id=hf_tok.eos_token_id,
                      pad_token_id=hf_tok.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # spread the weights: near-uniform logits would make greedy parity a matter of ties
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
        if never_eos:
            model.lm_head.weight[cfg.eos_token_id].zero_()
    model.save_pretrained(path)
    hf_tok.save_pretrained(path)
    gc = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, **(generation_config or {})}
    (path / "generation_config.json").write_text(json.dumps(gc))
    return path
