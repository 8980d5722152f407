"""Tiny random models the tests share: fast, awkwardly sized, and far from uniform so that bugs show."""

import contextlib
import dataclasses
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch

from tether.shared.config import PRESETS
from tether.shared.drafter import DrafterConfig
from tether.shared.drafter_loading import build_drafter
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


@contextlib.contextmanager
def served_tiny_pair(config, fingerprint: str, vocab_size: int) -> Iterator[tuple]:
    """tiny_target of `vocab_size` and its MoA drafter served over gRPC on loopback under `config` (a ServiceConfig):
    yields (target, drafter, service, stub); the server stops when the block ends."""
    import grpc

    from tether.server.engine_core import Engine
    from tether.server.rpc_server import make_server
    from tether.server.service import TetherService
    from tether.shared.tokenizer import Tokenizer
    from tether.v1 import tether_pb2_grpc

    target = tiny_target(vocab_size=vocab_size)
    drafter = tiny_moa_drafter(target)
    tok = Tokenizer.train(texts=["def f(x):\n    return x\n"] * 20, vocab_size=260)
    service = TetherService(Engine(target, drafter, tok, config, model_fingerprint=fingerprint))
    server, port = make_server(service, "127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield target, drafter, service, tether_pb2_grpc.TetherStub(channel)
    finally:
        channel.close()
        server.stop(grace=None)


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


def save_tiny_pairs(root: Path, vocab_size: int, max_files: int) -> None:
    """A stdlib corpus of `max_files` files in root/corpus, and tiny_pair's target (root/target, with the corpus's
    tokenizer) with its MoA and EAGLE drafters (root/moa, root/eagle): what the bench smoke tests measure."""
    from tether.server.train.corpus import build_corpus
    from tether.shared.drafter import save_drafter
    from tether.shared.tokenizer import Tokenizer

    build_corpus(root / "corpus", max_files=max_files, vocab_size=vocab_size, progress=False)
    for kind in ("moa", "eagle"):
        target, drafter = tiny_pair(kind, vocab_size=vocab_size)
        save_drafter(drafter, root / kind)
    target.save_pretrained(root / "target")  # tiny_pair draws the same target for both (seed 0)
    Tokenizer.from_pretrained(root / "corpus").save_pretrained(root / "target")


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
    _save_random_model(directory, kind, layers, backend.get_vocab_size(), bos=0, eos=eos)
    return directory


def _save_random_model(directory: Path, kind: str, layers: int, vocab_size: int, *, bos: int, eos: int) -> None:
    """A tiny random `kind` model saved by transformers into `directory`, its matrices drawn far from the init."""
    import transformers

    config_class, model_class = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                                 "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[kind]  # fmt: skip
    config = config_class(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=512, vocab_size=vocab_size,
                          bos_token_id=bos, eos_token_id=eos)  # fmt: skip
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(directory)


# ---- SentencePiece-style tokenizers and model folders ---------------------------------------------------------------


def byte_fallback_tokenizer(texts: Sequence[str], vocab_size: int = 350):
    """The Llama-2 / Mistral layout: `<unk> <s> </s>`, then the 256 byte tokens `<0x00>`..`<0xFF>`, then a BPE
    vocabulary over Metaspace ("▁" for a space, prepended to the first word) trained on `texts`; byte fallback
    for what it lacks; the decoder Replace / ByteFallback / Fuse / Strip as in Llama 2's tokenizer.json."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    trainer_tok = tokenizers.Tokenizer(models.BPE())
    trainer_tok.pre_tokenizer = metaspace
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, limit_alphabet=60, show_progress=False)
    trainer_tok.train_from_iterator(texts, trainer=trainer)
    trained = json.loads(trainer_tok.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for token in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = tokenizers.Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = metaspace
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok


def unigram_tokenizer(texts: Sequence[str], vocab_size: int = 300):
    """T5 / ALBERT style: Unigram trained on `texts`, a normalizer (NFKC, space runs folded), Metaspace before every
    word; specials `<pad> </s> <unk>` as ids 0, 1, 2."""
    import tokenizers
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>", show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


SENTENCEPIECE_TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's what they've said, isn't it? Don't stop!\n" * 3,
    "def tokenize(text):\n    return [word for word in text.split() if word]\n\nclass Model:\n    pass\n" * 3,
    "Hello there, how are you today? I am fine, thank you. What a lovely day it is.\n" * 3,
]
END_OF_TURN = "<|im_end|>"  # a second end-of-text, listed after </s> in generation_config.json
# Llama 2's chat layout ([INST] ... [/INST], the reply, </s>), shortened: no system block.
LLAMA2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ bos_token }}[INST] {{ message['content'] }}"
    " [/INST]{% else %} {{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


def write_sentencepiece_checkpoint(directory: Path, family: str, layers: int = 2) -> Path:
    """A tiny random Llama-shaped model folder with a SentencePiece-style tokenizer: `family` "byte_fallback" (Llama 2
    / Mistral: Metaspace and byte-fallback BPE) or "unigram" (T5-style Unigram). Written as such folders come:
    config.json (one eos id), generation_config.json (a list: `</s>` and END_OF_TURN), tokenizer.json,
    tokenizer_config.json (LLAMA2_CHAT_TEMPLATE, bos/eos tokens, clean_up_tokenization_spaces on, which transformers
    applies to Unigram and skips for BPE), model.safetensors."""
    build = {"byte_fallback": byte_fallback_tokenizer, "unigram": unigram_tokenizer}[family]
    backend = build(SENTENCEPIECE_TEXTS)
    backend.add_special_tokens([END_OF_TURN])
    directory.mkdir(parents=True)
    backend.save(str(directory / "tokenizer.json"))
    eos, end_of_turn = backend.token_to_id("</s>"), backend.token_to_id(END_OF_TURN)
    bos = backend.token_to_id("<s>")
    config = {"tokenizer_class": "LlamaTokenizerFast" if family == "byte_fallback" else "PreTrainedTokenizerFast",
              "chat_template": LLAMA2_CHAT_TEMPLATE, "eos_token": "</s>", "clean_up_tokenization_spaces": True,
              **({"bos_token": "<s>"} if bos is not None else {})}  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    _save_random_model(directory, "llama", layers, backend.get_vocab_size(), bos=bos or 0, eos=eos)
    generation = json.loads((directory / "generation_config.json").read_text())
    (directory / "generation_config.json").write_text(json.dumps(generation | {"eos_token_id": [eos, end_of_turn]}))
    return directory


def script_greedy(directory: Path, next_token: Mapping[int, int], scale: float = 4.0) -> None:
    """Rewrite `directory`'s Llama weights (written by write_sentencepiece_checkpoint) so that greedy decoding
    follows `next_token`: after token a the model writes next_token[a], whatever came before, by a wide margin.

    How: every layer's output projections (attention's o_proj, the MLP's down_proj) are zeroed, so the last hidden
    state is the last token's embedding; each scripted token's embedding is a basis vector of its own and the
    output row of the token it leads to reads that vector. At most hidden_size (64) scripted tokens."""
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    weights = load_file(path)
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]  # [V, H] each
    if len(next_token) > embed.shape[1]:
        raise ValueError(f"{len(next_token)} scripted tokens, at most {embed.shape[1]}")
    for name, w in weights.items():
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            w.zero_()
    head.zero_()
    for slot, (token, following) in enumerate(next_token.items()):
        embed[token] = 0.0
        embed[token, slot] = 1.0
        head[following, slot] = scale
    save_file(weights, path, metadata={"format": "pt"})
