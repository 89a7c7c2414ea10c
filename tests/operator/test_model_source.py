"""Reading config.json from each kind of model source (local files, an offline hub cache)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from huggingface_hub import constants

from kvpilot.operator.model_source import load_model_spec, read_model_config
from kvpilot.operator.planner import PlanError
from kvpilot.operator.spec import ModelSource, parse_spec

CONFIGS = Path(__file__).parent / "configs"
LLAMA3_8B = json.loads((CONFIGS / "Meta-Llama-3-8B.json").read_text())


def source(model: dict) -> ModelSource:
    return parse_spec({"model": model}).model


def test_inline_config_wins():
    model = source({"source": "pvc://weights/llama", "config": LLAMA3_8B})
    assert load_model_spec(model).num_parameters() == 8_030_261_248


def test_file_source_reads_the_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    assert read_model_config(source({"source": f"file://{tmp_path}"})) == LLAMA3_8B
    with pytest.raises(PlanError) as caught:
        read_model_config(source({"source": f"file://{tmp_path}/missing"}))
    assert caught.value.reason == "ConfigUnavailable"
    assert "spec.model.config" in caught.value.message


def test_pvc_source_without_config_is_unavailable():
    with pytest.raises(PlanError) as caught:
        read_model_config(ModelSource(source="pvc://weights", scheme="pvc", claim_name="weights"))
    assert caught.value.reason == "ConfigUnavailable"


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """A Hugging Face cache holding org/llama's config.json at revision main, hub offline."""
    repo = tmp_path / "hub" / "models--org--llama"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text(json.dumps(LLAMA3_8B))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_hub_source_fetches_config_json_only(offline_hub):
    assert read_model_config(source({"source": "hf://org/llama", "revision": "main"})) == LLAMA3_8B
    with pytest.raises(PlanError) as caught:
        read_model_config(source({"source": "hf://org/other"}))
    assert caught.value.reason == "ConfigUnavailable"
    assert "hf://org/other" in caught.value.message


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ({**LLAMA3_8B, "num_hidden_layers": None}, "InvalidModelConfig"),
        ({**LLAMA3_8B, "kv_lora_rank": 512}, "UnsupportedArchitecture"),
    ],
)
def test_unusable_configs(config, reason):
    with pytest.raises(PlanError) as caught:
        load_model_spec(source({"config": config}))
    assert caught.value.reason == reason


def test_builtin_default_reads_the_gguf_metadata():
    """The default model's sizes, from the GGUF the engine serves, match its public config."""
    default = load_model_spec(ModelSource())
    public = load_model_spec(
        source({"config": json.loads((CONFIGS / "SmolLM2-135M-Instruct.json").read_text())})
    )
    assert default.num_parameters() == public.num_parameters() == 134_515_008
    assert default.kv_bytes_per_token(4) == public.kv_bytes_per_token(4)
    assert default.is_supported_by_engine


# A fresh interpreter (transformers not imported yet): threads read the default model and a
# .gguf file source at the same moment, as kopf's handler threads can.
CONCURRENT_READS = textwrap.dedent(
    """
    import importlib.util, pathlib, threading
    from kvpilot.engine.model_loader.resolve import DEFAULT_GGUF_NAME, DEFAULT_MODEL_PACKAGE
    from kvpilot.operator.model_source import read_model_config
    from kvpilot.operator.spec import parse_spec

    package = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE).submodule_search_locations[0]
    gguf = pathlib.Path(package) / DEFAULT_GGUF_NAME
    sources = [parse_spec({}).model, parse_spec({"model": {"source": f"file://{gguf}"}}).model]
    barrier = threading.Barrier(4)
    layers, errors = [], []

    def read(source):
        barrier.wait()
        try:
            layers.append(read_model_config(source)["num_hidden_layers"])
        except Exception as error:
            errors.append(repr(error))

    threads = [threading.Thread(target=read, args=(sources[i % 2],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(sorted(layers), errors)
    """
)


@pytest.mark.slow  # a fresh interpreter importing transformers and torch: about 20 s
def test_concurrent_first_reads_all_succeed():
    """Several threads reading GGUF sources before transformers is imported all get the config
    (transformers' lazy imports raise ImportError when two threads race through them)."""
    done = subprocess.run(
        [sys.executable, "-c", CONCURRENT_READS],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[30, 30, 30, 30] []"
