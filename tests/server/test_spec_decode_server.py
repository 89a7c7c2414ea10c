"""``kvpilot serve --speculative-config``: completions through the official ``openai`` client
over real HTTP, the ``vllm:spec_decode_*`` counters read back from ``/metrics``, and a bad
config refused at start-up with a message naming the problem."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest

from kvpilot.engine.model_loader import DEFAULT_MODEL_NAME as MODEL

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}
PROMPT = "Repeat this list exactly:\n- apples: 3 kg\n- pears: 2 kg\n- plums: 1 kg\n- grapes: 4 kg\n"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def servers(start_server):
    flags = ("--max-model-len", "512", "--max-num-seqs", "4")
    plain = start_server(*flags)
    spec = start_server(*flags, "--speculative-config", json.dumps(NGRAM))
    return plain, spec


def test_greedy_completion_matches_and_counters_are_exported(servers, api_key):
    texts = []
    for server in servers:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0)
        completion = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT}],
            temperature=0,
            max_tokens=48,
        )
        texts.append(completion.choices[0].message.content)
    assert texts[0] == texts[1] and texts[1]
    metrics = servers[1].metrics()
    labels = (("model_name", MODEL),)
    drafts = metrics[("vllm:spec_decode_num_draft_tokens_total", labels)]
    accepted = metrics[("vllm:spec_decode_num_accepted_tokens_total", labels)]
    assert metrics[("vllm:spec_decode_num_drafts_total", labels)] > 0
    assert 0 < accepted <= drafts
    first = metrics[
        ("vllm:spec_decode_num_accepted_tokens_per_pos_total", (*labels, ("position", "0")))
    ]
    assert 0 < first <= accepted
    assert ("vllm:spec_decode_num_drafts_total", labels) not in servers[0].metrics()


def test_bad_speculative_config_is_refused_at_start_up():
    config = json.dumps({"method": "ngram", "num_speculative_tokens": 0})
    result = subprocess.run(
        [sys.executable, "-m", "kvpilot", "serve", "--speculative-config", config],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "num_speculative_tokens must be an integer >= 1, got 0" in result.stdout + result.stderr


def test_response_format_is_served_without_speculation(servers, api_key):
    # Constrained requests are decoded one token a step on a speculative server: the same
    # greedy JSON as without speculation.
    schema = {
        "type": "object",
        "properties": {"fruit": {"type": "string"}, "kg": {"type": "integer"}},
        "required": ["fruit", "kg"],
    }
    texts = []
    for server in servers:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0)
        completion = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT + "Give the first item as JSON."}],
            temperature=0,
            max_tokens=48,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "item", "schema": schema},
            },
        )
        texts.append(completion.choices[0].message.content)
    assert texts[0] == texts[1]
    item = json.loads(texts[1])
    assert set(item) == {"fruit", "kg"} and isinstance(item["kg"], int)
