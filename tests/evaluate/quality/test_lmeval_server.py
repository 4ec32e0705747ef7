"""lm-eval's own `local-completions` client pointed at `kiln serve` (token-ID prompts) gives the same
per-document log-likelihoods as the in-process KilnLM adapter, on kiln's shipped tasks."""

from __future__ import annotations

import pytest

from kiln.engine.serve.server_thread import ServerThread
from kiln.evaluate.quality.lmeval import prepare_tasks, task_manager
from kiln.evaluate.quality.lmeval_adapter import KilnLM

KEY = "lmeval-test-key"
LIMIT = 4


def _per_doc(lm, tasks) -> dict[str, list[list[float]]]:
    """Each document's log-likelihoods (one per request), by task, as lm-eval logged them."""
    from lm_eval import simple_evaluate

    out = simple_evaluate(model=lm, tasks=tasks.names, task_manager=task_manager(tasks.include_paths),
                          limit=LIMIT, log_samples=True, bootstrap_iters=0)
    return {t: [[float(r[0][0]) if isinstance(r[0], (list, tuple)) else float(r[0]) for r in s["resps"]]
                for s in sorted(out["samples"][t], key=lambda s: s["doc_id"])] for t in tasks.names}


def test_local_completions_through_kiln_serve_matches_the_adapter(engine, tiny_model_dir, data, tmp_path,
                                                                  monkeypatch):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    tasks = prepare_tasks(["word_swap", "gsm8k_answer", "heldout"], tmp_path, data)
    adapter = _per_doc(KilnLM(engine=engine, batch_size=8), tasks)
    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # LocalCompletionsAPI sends it as the Bearer token
    with ServerThread(engine, api_key=KEY, model_name="tiny") as server:
        client = LocalCompletionsAPI(base_url=f"{server.url}/v1/completions", model="tiny",
                                     tokenizer_backend="huggingface", tokenizer=str(tiny_model_dir),
                                     tokenized_requests=True, batch_size=4,
                                     max_length=engine.max_positions + 2)  # same rolling windows
        served = _per_doc(client, tasks)
    assert not engine.has_work()
    for task in tasks.names:
        assert len(served[task]) == len(adapter[task]) == LIMIT
        for ours, theirs in zip(adapter[task], served[task], strict=True):
            assert ours == pytest.approx(theirs, abs=2e-3), task
