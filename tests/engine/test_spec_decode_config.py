"""``speculative_config`` in vLLM's JSON shape: defaults, and clear errors for bad values."""

from __future__ import annotations

import pytest

from kvpilot.engine.spec_decode.config import SpeculativeConfig


def test_ngram_json_is_parsed():
    config = SpeculativeConfig.from_json(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
        '"prompt_lookup_max": 5}'
    )
    assert (config.method, config.num_speculative_tokens) == ("ngram", 4)
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (2, 5)
    assert SpeculativeConfig.from_json(config.to_dict()) == config


def test_ngram_lookup_bounds_default_like_vllm():
    both = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 3})
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5)
    only_max = SpeculativeConfig.from_json(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    )
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    only_min = SpeculativeConfig.from_json(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}
    )
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (2, 2)


def test_draft_model_method_is_inferred_from_model():
    config = SpeculativeConfig.from_json({"model": "/models/draft", "num_speculative_tokens": 2})
    assert config.method == "draft_model"
    assert config.model == "/models/draft"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            {"method": "ngram", "num_speculative_tokens": 0},
            "num_speculative_tokens must be an integer >= 1",
        ),
        ({"method": "ngram", "num_speculative_tokens": -2}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens"),
        ({"method": "ngram"}, "'num_speculative_tokens' is required"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "unknown method 'medusa'"),
        ({"num_speculative_tokens": 2}, "'method' is required"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown key"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "takes no 'model'"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min \\(4\\) must be <= prompt_lookup_max \\(2\\)",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
            "prompt_lookup_min",
        ),
        (
            {
                "method": "draft_model",
                "model": "x",
                "num_speculative_tokens": 2,
                "prompt_lookup_max": 3,
            },
            "applies to method 'ngram' only",
        ),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_bad_configs_are_refused_with_a_clear_message(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_json(value)
