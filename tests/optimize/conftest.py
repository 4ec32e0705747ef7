"""A tiny Llama checkpoint built from a config, so quantizer tests run in seconds.

Dimensions are multiples of 128 (hidden 128, intermediate 256, 4 heads of 32, 2 KV heads) so
every group size kiln's methods use divides them. The tokenizer is a byte-level BPE trained on
the fly on a few sentences: real tokenization, no download.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY_CONFIG = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a model that scores well on a benchmark has done half its job",
    "quantization moves fewer bytes per token and frees memory for the cache",
    "calibration text is run through the model to measure what gets quantized",
]


def corpus(n: int = 400, offset: int = 0) -> str:
    """Deterministic varied text: sentences with numbers, one paragraph per line."""
    return "\n".join(f"{SENTENCES[(i + offset) % len(SENTENCES)]} {i} {i * 7 % 13} and then {SENTENCES[i % 3]}."
                     for i in range(n))


def build_tiny_bpe_llama(out: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus().splitlines(), trainers.BpeTrainer(
        vocab_size=1024, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(out)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY_CONFIG)).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """Folder with config.json, model.safetensors (fp32, untied lm_head) and a tokenizer."""
    return build_tiny_bpe_llama(tmp_path_factory.mktemp("tiny-llama") / "model")


@pytest.fixture(scope="session")
def tiny_calibration(tiny_llama, tmp_path_factory):
    from kiln.optimize.calibration import CalibrationConfig, build_calibration

    text = tmp_path_factory.mktemp("calib") / "calibration.txt"
    text.write_text(corpus(300, offset=1))
    return build_calibration(CalibrationConfig(dataset=str(text), samples=8, seq_len=64), tiny_llama)


def reload_and_generate(path: Path, prompt: str = "the quick brown", new_tokens: int = 6):
    """Load a checkpoint folder the way a user would and greedily generate; returns (model, ids)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    ids = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return model, out[0, ids["input_ids"].shape[1]:].tolist()


def logits(model, text_ids: list[int]):
    import torch

    with torch.no_grad():
        return model(torch.tensor([text_ids])).logits[0].float()


@pytest.fixture(scope="session")
def make_corpus():
    """`corpus(n, offset)`: deterministic text, one paragraph per line."""
    return corpus


@pytest.fixture(scope="session")
def reload():
    """`reload(path) -> (model, greedy token ids)`, and `.logits(model, ids)`."""
    reload_and_generate.logits = logits
    return reload_and_generate
