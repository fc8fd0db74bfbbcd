"""MEPIC's options are one pydantic model: wrong keys, types and ranges fail when it is built."""

from __future__ import annotations

import dataclasses

import pytest

from ascend_mepic.config import MepicConfig


def build(options: dict) -> MepicConfig:
    return MepicConfig.from_additional_config({"mepic": options})


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"enabled": "false"}, "'enabled': Input should be a valid boolean, got 'false'"),
        ({"max_chunks_per_request": 2.0}, "'max_chunks_per_request': Input should be a valid int"),
        ({"max_chunks_per_request": True}, "'max_chunks_per_request': Input should be a valid int"),
        ({"compile_token_fraction": 0}, "'compile_token_fraction': Input should be greater than 0"),
        ({"compile_token_fraction": 1.5}, "'compile_token_fraction': Input should be less than or"),
        ({"blend_check_layer": -1}, "'blend_check_layer': Input should be greater than or equal"),
        ({"policy": "epic"}, "'policy': policy 'epic' needs a number"),
        ({"chunk_begin": ""}, "'chunk_begin': String should have at least 1 character"),
        ({"tier": {"cpu_gib": "1"}}, "'tier.cpu_gib': Input should be a valid number, got '1'"),
        (
            {"tier": {"load": "sometimes"}},
            "'tier.load': Input should be 'auto', 'always' or 'never'",
        ),
        (
            {"tier": {"cpu": 1}},
            "unknown MEPIC tier option 'tier.cpu'; known: ['enabled', 'cpu_gib'",
        ),
        ({"blocksize": 3}, "unknown MEPIC option 'blocksize'; known: ['enabled', 'policy'"),
        ({"tier": [1]}, "'tier': Input should be a dictionary or an instance of TierConfig"),
        ({"chunk_anchor": "system"}, "'chunk_anchor': Input should be 'first', 'none' or 'prefix'"),
        ({"chunk_anchor_max_tokens": 0}, "'chunk_anchor_max_tokens': Input should be greater"),
        (
            {"chunk_anchor": "prefix", "policy": "epic-16"},
            "'chunk_anchor': 'prefix' applies to shared-placement policies",
        ),
    ],
)
def test_a_wrong_option_fails_when_the_config_is_built_naming_the_field(options, words):
    with pytest.raises(ValueError) as e:
        build(options)
    assert words in str(e.value)


def test_every_error_is_reported_at_once_and_valid_options_are_typed_and_frozen():
    with pytest.raises(ValueError, match="'enabled'.*; .*'compile_token_fraction'"):
        build({"enabled": "yes", "compile_token_fraction": 2})
    config = build(
        {"compile_token_fraction": 1, "tier": {"cpu_gib": 2, "disk": "/x", "unauthenticated": True}}
    )
    assert config.compile_token_fraction == 1.0 and type(config.compile_token_fraction) is float
    assert (
        config.tier.enabled and config.tier.cpu_gib == 2.0 and not build({"tier": {}}).tier.enabled
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.policy = "full"  # type: ignore[misc]
    with pytest.raises(ValueError, match="less than or equal to 1"):
        dataclasses.replace(config, compile_token_fraction=3.0)  # a copy is validated too
    assert not MepicConfig.from_additional_config({}).enabled


def test_the_offline_api_checks_its_options_at_the_call():
    from ascend_mepic.offline import mepic_llm_kwargs

    with pytest.raises(
        ValueError, match="'compile_token_fraction': Input should be a valid number"
    ):
        mepic_llm_kwargs(compile_token_fraction="0.5")
    kwargs = mepic_llm_kwargs(policy="full")
    assert kwargs["additional_config"] == {"mepic": {"policy": "full"}}
    assert not kwargs["enable_prefix_caching"]
