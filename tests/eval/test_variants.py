"""Benchmark variants: a policy with MEPIC options, ``POLICY,OPTION=VALUE``."""

from __future__ import annotations

import pytest

from ascend_mepic.eval.bench.variants import check_variant, split_variant


def test_a_variant_is_a_policy_and_typed_options():
    assert split_variant("mepic") == ("mepic", {})
    assert split_variant("mepic,chunk_anchor=prefix, chunk_anchor_max_tokens=32") == (
        "mepic",
        {"chunk_anchor": "prefix", "chunk_anchor_max_tokens": 32},
    )
    check_variant("mepic,chunk_anchor=prefix")
    check_variant("prefix")


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("mepic,chunk_anchor", "'chunk_anchor' is not OPTION=VALUE"),
        ("mepic,policy=naive", "option 'policy' given twice"),
        ("mepic,chunk_anchor=system", "Input should be 'first', 'none' or 'prefix'"),
        ("epic-16,chunk_anchor=prefix", "applies to shared-placement policies"),
        ("prefix,chunk_anchor=prefix", "stock vLLM (prefix) takes no MEPIC option"),
        ("mepik", "unknown policy 'mepik'"),
    ],
)
def test_a_wrong_variant_fails_naming_the_part(spec, words):
    with pytest.raises(ValueError, match=None) as info:
        check_variant(spec)
    assert words in str(info.value)
