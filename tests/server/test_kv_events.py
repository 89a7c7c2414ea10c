"""``GET /kv_events`` of an in-process server over the tiny model: the engine's own hashes, the
API key, and ``truncated`` once the log has dropped the events asked for."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from kvpilot.engine import LLM
from kvpilot.engine.config import CPU_BLOCK_SIZE
from kvpilot.engine.kv_cache_manager import extend_block_hashes
from kvpilot.engine.kv_events import KVEventLog
from kvpilot.engine.server.app import ServerConfig, create_app
from kvpilot.engine.tokenization import encode_text

KEY = "kv-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "A block of sixteen tokens, and then another one, and a third. " * 3


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    engines = []

    def load():
        engine = LLM(str(tiny_model_dir("llama")), max_model_len=256).llm_engine
        engines.append(engine)
        return engine

    app = create_app(load, ServerConfig(["tiny"], api_keys=[KEY]))
    with TestClient(app) as client:
        deadline = time.monotonic() + 120
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the model did not load"
            time.sleep(0.1)
        yield client, engines[0]


def complete(client: TestClient, prompt: str) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    assert client.post("/v1/completions", json=body, headers=AUTH).status_code == 200


def test_the_endpoint_publishes_the_engines_hashes(served) -> None:
    client, engine = served
    assert client.get("/kv_events").status_code == 401
    start = client.get("/kv_events", headers=AUTH).json()["next"]
    complete(client, PROMPT)
    answer = client.get("/kv_events", params={"since": start}, headers=AUTH).json()
    tokens = encode_text(engine.tokenizer, PROMPT, "prompt")
    root = engine.kv_cache_manager.root_hash
    # The CPU default block size: the engine was given none.
    assert answer["root_hash"] == root.hex() and answer["block_size"] == CPU_BLOCK_SIZE
    assert engine.block_size == CPU_BLOCK_SIZE
    assert not answer["truncated"]
    full = extend_block_hashes([], tokens, CPU_BLOCK_SIZE, root)
    assert len(full) >= 2
    # The prompt's full blocks, in order (a last block filled by the output token may follow).
    stored = [e["block_hash"] for e in answer["events"] if e["type"] == "BlockStored"]
    assert stored[: len(full)] == [h.hex() for h in full]
    assert [e["seq"] for e in answer["events"]] == list(range(start, answer["next"]))
    again = client.get("/kv_events", params={"since": answer["next"]}, headers=AUTH).json()
    assert again["events"] == [] and not again["truncated"]
    assert client.get("/kv_events", params={"since": -1}, headers=AUTH).status_code in (400, 422)


def test_a_reader_behind_the_log_is_told_truncated(served) -> None:
    client, engine = served
    engine.kv_cache_manager.block_pool.kv_events = KVEventLog(max_events=2)
    complete(client, "Nothing shared with the first prompt: other words, other blocks. " * 4)
    answer = client.get("/kv_events", params={"since": 0}, headers=AUTH).json()
    assert answer["truncated"] and len(answer["events"]) == 2
    assert [e["seq"] for e in answer["events"]] == [answer["next"] - 2, answer["next"] - 1]
