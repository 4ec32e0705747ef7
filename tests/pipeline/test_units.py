"""Figures as a person reads them (kiln.core.units) on the console, in the report and in `kiln show`: the unit
each metric declares or its name implies, never `size_bytes=5.416e+08`."""

import pytest

from kiln.core.units import amount, number


@pytest.mark.parametrize(("name", "value", "shown"), [
    ("size_bytes", 5.416e8, "541.6 MB"),  # a size on disk: decimal
    ("size_bytes", 1.5e9, "1.5 GB"),
    ("peak_rss_bytes", 2.763e8, "263.5 MiB"),  # memory: binary
    ("optimize_children_peak_pss_bytes", 3 << 30, "3.0 GiB"),
    ("engine_children_peak_pss_bytes", 0, "0 B"),
    ("decode_tok_s", 110.66, "110.7 tok/s"),
    ("baseline.decode_tok_s", 17.09, "17.09 tok/s"),  # a role's figure reads as its metric's
    ("ttft_ms", 176.6, "176.6 ms"),
    ("top1_agreement", 0.9613, "96.1%"),
    ("bench_cpu_pressure", 0.0111, "1.1%"),
    ("kl_mean", 0.003473, "0.003473 nats"),
    ("quantize_s", 22.55, "22.55 s"),
    ("perplexity", 66.42, "66.42"),
    ("served_prompts", 18, "18"),
    ("perplexity", None, "—"),
])
def test_each_figure_carries_its_unit(name, value, shown):
    assert amount(name, value) == shown


def test_no_e_notation_a_reader_has_to_decode():
    assert number(123456.7) == "123,457"
    assert number(0.00012) == "0.00012"
    assert "e" not in amount("size_bytes", 5.416e8) + amount("peak_rss_bytes", 2.763e8)
