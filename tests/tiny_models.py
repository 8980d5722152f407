"""Tiny random models the tests share: fast, awkwardly sized, and far from uniform so that bugs show."""

import dataclasses
from pathlib import Path

import torch

from tether.shared.config import PRESETS
from tether.shared.drafter import DrafterConfig, build_drafter
from tether.shared.model import Transformer


def tiny_target(seed: int = 0, std: float = 0.15, **overrides) -> Transformer:
    """The "tiny" preset (with overrides), its matrices redrawn with a larger std than the training init."""
    torch.manual_seed(seed)
    model = Transformer(dataclasses.replace(PRESETS["tiny"], **overrides)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, std)
    return model


def tiny_moa_drafter(target: Transformer, tli: int = 1):
    return build_drafter(target, DrafterConfig(kind="moa", tli=tli, n_heads=4, n_kv_heads=2, head_dim=12)).eval()


def tiny_pair(kind: str, vocab_size: int, tli: int = 1):
    """A tiny target of `vocab_size` and a drafter of `kind` ("moa" or "eagle") whose matrices are redrawn far from
    their near-zero init, so that a wrong row or position shows in the logits."""
    target = tiny_target(vocab_size=vocab_size)
    if kind == "moa":
        drafter = tiny_moa_drafter(target, tli=tli)
    else:
        torch.manual_seed(1)
        drafter = build_drafter(target, DrafterConfig(kind="eagle", n_heads=4, n_kv_heads=2, head_dim=12)).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    return target, drafter


HF_SPECIALS = {
    "llama": ("<|begin_of_text|>", "<|end_of_text|>"),
    "qwen2": ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
}


def write_hf_checkpoint(directory: Path, kind: str, layers: int = 3) -> Path:
    """A Hugging Face model directory (config.json, generation_config.json, model.safetensors, tokenizer.json) of a
    tiny random `kind` ("llama" or "qwen2") model, written by transformers' save_pretrained with a byte-level BPE
    tokenizer trained by `tokenizers`; its weights are drawn far from transformers' small init so that greedy
    decoding has clear winners and writes text."""
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=list(HF_SPECIALS[kind]), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    library = Path(transformers.__file__).parent
    backend.train_from_iterator([(library / name).read_text() for name in ("__init__.py", "activations.py")],
                                trainer=trainer)  # fmt: skip
    directory.mkdir(parents=True)
    backend.save(str(directory / "tokenizer.json"))
    eos = backend.token_to_id(HF_SPECIALS[kind][1 if kind == "llama" else 0])
    config_class, model_class = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                                 "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[kind]  # fmt: skip
    config = config_class(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=512, vocab_size=backend.get_vocab_size(),
                          bos_token_id=0, eos_token_id=eos)  # fmt: skip
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(directory)
    return directory
