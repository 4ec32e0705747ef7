"""Checkpoints outside the Llama family: a GPT-2 (n_embd, n_layer, fused c_attn) runs the whole
pipeline with the pass-through method on the torch engine, which serves it; the shape reader no
longer refuses it up front."""

from __future__ import annotations

import json

from tests.pipeline.conftest import kiln, write_recipe


def test_gpt2_runs_end_to_end_with_none_on_torch(tmp_path, demo_model):
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tok = AutoTokenizer.from_pretrained(demo_model)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=len(tok), n_positions=1024,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model_dir = tmp_path / "gpt2"
    GPT2LMHeadModel(config).eval().save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    recipe = write_recipe(tmp_path / "gpt2.yaml", model_dir, name="gpt2", optimize={"method": "none"},
                          gate={"checks": [{"kind": "quality", "metric": "perplexity", "margin": 0.05, "relative": True}]})
    proc = kiln("run", str(recipe), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    run_dir = next((tmp_path / "runs").iterdir())
    verdict = json.loads((run_dir / "verdict.json").read_text())
    assert verdict["verdict"] == "Successful"  # the candidate is the baseline: nothing can differ
