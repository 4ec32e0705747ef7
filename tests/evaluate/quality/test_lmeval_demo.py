"""The shipped tasks on the real demo model: they measure something, and damage shows.

A deliberately broken candidate (torch dynamic int8 on every Linear, lm_head included, applied
in memory) must score clearly worse than the fp32 baseline on the same documents.
"""

from __future__ import annotations

import pytest

from kiln.evaluate.quality.lmeval import prepare_tasks, run_lmeval

pytestmark = pytest.mark.slow
SWAP_ITEMS = 100  # of the 400: enough to separate 0.95 from 0.84, half the time
HELDOUT_DOCS = 4


def _run(engine, tasks, out):
    swap = run_lmeval(engine, ["word_swap"], tasks.include_paths, SWAP_ITEMS, out / "swap")[0]
    heldout = run_lmeval(engine, ["heldout"], tasks.include_paths, HELDOUT_DOCS, out / "heldout")[0]
    return swap, heldout


def test_word_swap_separates_fp32_from_a_broken_int8_model(demo_model, demo_data, tmp_path):
    import torch

    from kiln.engine.hf_torch import TorchEngine, TorchEngineConfig

    tasks = prepare_tasks(["word_swap", "heldout"], tmp_path / "tasks", demo_data)
    engine = TorchEngine(demo_model, TorchEngineConfig())
    base_swap, base_ppl = _run(engine, tasks, tmp_path / "base")
    torch.ao.quantization.quantize_dynamic(engine.model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
    cand_swap, cand_ppl = _run(engine, tasks, tmp_path / "int8")
    engine.close()

    base, cand = base_swap.metrics["word_swap_acc"], cand_swap.metrics["word_swap_acc"]
    print(f"word_swap_acc fp32 {base:.3f}, int8 everywhere {cand:.3f}; heldout word perplexity "
          f"{base_ppl.metrics['heldout_word_perplexity']:.1f} -> {cand_ppl.metrics['heldout_word_perplexity']:.1f}")
    assert base > 0.8
    assert cand < base - 0.05
    b, c = base_swap.column("word_swap_acc"), cand_swap.column("word_swap_acc")
    assert b.keys() == c.keys() and len(b) == SWAP_ITEMS
    lost = sum(1 for k in b if b[k] == 1 and c[k] == 0)
    won = sum(1 for k in b if b[k] == 0 and c[k] == 1)
    assert lost > 2 * won  # the damage is in the pairs, not in noise
    assert cand_ppl.metrics["heldout_word_perplexity"] > 1.2 * base_ppl.metrics["heldout_word_perplexity"]
