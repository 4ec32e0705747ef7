"""Per-document metric functions for kiln's shipped lm-eval tasks (`!function` in their YAML).

lm-eval imports this file by path from the folder the task YAMLs are rendered into, so it must
stand alone: no kiln imports.
"""

import re


def answer_logprob(doc, results):
    """GSM8K reference answer: its total log-likelihood, and (ll, bytes) for bits per byte."""
    loglikelihood, _is_greedy = results[0]
    return {"logprob": loglikelihood,
            "bits_per_byte": (loglikelihood, len(doc["continuation"].encode("utf-8")))}


def rolling_perplexity(doc, results):
    """Held-out text: (ll, words) and (ll, bytes) pairs, aggregated over documents by lm-eval."""
    (loglikelihood,) = results
    words = len(re.split(r"\s+", doc["text"].strip()))
    n_bytes = len(doc["text"].encode("utf-8"))
    return {"word_perplexity": (loglikelihood, words),
            "byte_perplexity": (loglikelihood, n_bytes),
            "bits_per_byte": (loglikelihood, n_bytes)}
