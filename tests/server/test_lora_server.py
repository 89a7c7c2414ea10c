"""Multi-LoRA over real HTTP: adapters as ``model``, ``/v1/models`` with ``parent``, run-time
``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``, 404/400 answers and
``vllm:lora_requests_info``; greedy outputs equal transformers + peft on the same adapters."""

from __future__ import annotations

import functools
import pathlib
import shutil

import httpx
import openai
import peft
import pytest
import torch
import transformers

from kvpilot.engine.model_loader import resolve_model
from tests.engine.test_lora import reference_greedy

BASE = "tiny-base"
PROMPT = [5, 17, 300, 41, 9, 1200, 77, 8]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> pathlib.Path:
    """A tiny random Llama with SmolLM2's tokenizer (what the engine tests build)."""
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (resolve_model(None) / name).is_file():
            shutil.copy(resolve_model(None) / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def adapters(base_dir, tmp_path_factory) -> dict[str, pathlib.Path]:
    """Three PEFT adapters with random weights, saved by ``save_pretrained``."""
    root = tmp_path_factory.mktemp("adapters")
    targets = [["q_proj", "v_proj"], ["gate_proj", "up_proj", "down_proj"], ["k_proj", "o_proj"]]
    folders = {}
    for seed, (name, target_modules) in enumerate(
        zip(["sql", "chat", "late"], targets, strict=True)
    ):
        base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
        model = peft.get_peft_model(
            base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=target_modules)
        )
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_" in param_name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
        folders[name] = root / name
        model.save_pretrained(folders[name])
    return folders


@functools.cache
def peft_greedy(base_dir: pathlib.Path, adapter_dir: pathlib.Path | None) -> list[int]:
    return reference_greedy(base_dir, adapter_dir, PROMPT, MAX_TOKENS)


@pytest.fixture(scope="module")
def server(start_server, base_dir, adapters):
    return start_server(
        "--model", str(base_dir), "--served-model-name", BASE, "--max-model-len", "128",
        "--enable-lora", "--max-loras", "2",
        "--lora-modules", f"sql={adapters['sql']}", f"chat={adapters['chat']}",
    )  # fmt: skip


@pytest.fixture(scope="module")
def client(server, api_key) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0)


def completion(client: openai.OpenAI, model: str) -> tuple[str, str]:
    """Greedy completion of ``PROMPT``: the reported model and the text."""
    response = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return response.model, response.choices[0].text


def expected_text(base_dir, adapter_dir) -> str:
    tokenizer = transformers.AutoTokenizer.from_pretrained(base_dir)
    return tokenizer.decode(peft_greedy(base_dir, adapter_dir), skip_special_tokens=True)


def test_adapters_as_model_match_peft(client, base_dir, adapters) -> None:
    texts = {}
    for name in ("sql", "chat"):
        texts[name] = expected_text(base_dir, adapters[name])
        assert completion(client, name) == (name, texts[name])
    texts[BASE] = expected_text(base_dir, None)
    assert completion(client, BASE) == (BASE, texts[BASE])
    assert len(set(texts.values())) == 3  # the adapters change the output
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        completion(client, "nope")
    chat = client.chat.completions.create(
        model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0
    )
    assert chat.model == "sql"


def test_models_lists_adapters_with_parent(server, api_key, adapters) -> None:
    headers = {"Authorization": f"Bearer {api_key}"}
    cards = httpx.get(f"{server.url}/v1/models", headers=headers).json()["data"]
    by_id = {card["id"]: card for card in cards}
    assert list(by_id) == [BASE, "sql", "chat"]
    assert by_id[BASE]["parent"] is None
    assert by_id["sql"]["parent"] == BASE
    assert by_id["sql"]["root"] == str(adapters["sql"])


def test_load_and_unload_at_run_time(client, server, api_key, base_dir, adapters, tmp_path):
    def post(path: str, **body) -> httpx.Response:
        headers = {"Authorization": f"Bearer {api_key}"}
        return httpx.post(f"{server.url}/v1/{path}", json=body, headers=headers, timeout=60)

    loaded = post("load_lora_adapter", lora_name="late", lora_path=str(adapters["late"]))
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'late' added successfully."
    # Three adapters, two slots: "late" evicts the least recently used idle one.
    assert completion(client, "late") == ("late", expected_text(base_dir, adapters["late"]))
    for name in ("sql", "chat", "late"):
        assert completion(client, name)[1] == expected_text(base_dir, adapters[name])

    again = post("load_lora_adapter", lora_name="late", lora_path=str(adapters["sql"]))
    assert again.status_code == 400
    assert "has already been loaded" in again.json()["error"]["message"]
    missing = post("load_lora_adapter", lora_name="gone", lora_path=str(tmp_path / "none"))
    assert missing.status_code == 400
    assert "is not a folder" in missing.json()["error"]["message"]
    bad = tmp_path / "bad"
    shutil.copytree(adapters["sql"], bad)
    (bad / "adapter_config.json").write_text('{"peft_type": "LORA", "use_dora": true}')
    dora = post("load_lora_adapter", lora_name="dora", lora_path=str(bad))
    assert dora.status_code == 400
    assert "DoRA" in dora.json()["error"]["message"]

    unloaded = post("unload_lora_adapter", lora_name="late")
    assert unloaded.status_code == 200, unloaded.text
    with pytest.raises(openai.NotFoundError):
        completion(client, "late")
    assert post("unload_lora_adapter", lora_name="late").status_code == 404
    assert "late" not in [m.id for m in client.models.list().data]


def test_an_adapter_whose_files_are_gone_is_refused_naming_model_and_unlisted(
    start_server, api_key, base_dir, adapters, tmp_path
) -> None:
    # One host copy: registering "chat" at start drops that of "gone", whose folder is then
    # deleted; a request for it cannot read it again.
    folder = tmp_path / "gone"
    shutil.copytree(adapters["sql"], folder)
    server = start_server(
        "--model", str(base_dir), "--served-model-name", BASE, "--max-model-len", "128",
        "--enable-lora", "--max-loras", "1", "--max-cpu-loras", "1",
        "--lora-modules", f"gone={folder}", f"chat={adapters['chat']}",
    )  # fmt: skip
    client = server.openai_client()
    shutil.rmtree(folder)
    with pytest.raises(openai.BadRequestError) as refused:
        completion(client, "gone")
    assert (refused.value.param, refused.value.body["message"]) == (
        "model",
        f"LoRA adapter 'gone': its files are gone from {folder} (adapter_config.json, "
        "adapter_model.safetensors deleted since it was loaded), so it was unloaded; load it "
        "again to use it",
    )
    assert [m.id for m in client.models.list().data] == [BASE, "chat"]
    with pytest.raises(openai.NotFoundError, match="The model `gone` does not exist"):
        completion(client, "gone")
    # The engine forgot it too: the name loads again, from another folder.
    loaded = httpx.post(
        f"{server.url}/v1/load_lora_adapter",
        json={"lora_name": "gone", "lora_path": str(adapters["sql"])},
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=60,
    )
    assert loaded.status_code == 200, loaded.text
    assert completion(client, "gone") == ("gone", expected_text(base_dir, adapters["sql"]))


def test_lora_requests_info_names_running_adapters(client, server) -> None:
    server.wait_for(lambda: _lora_info(server) is not None)
    labels = _lora_info(server)
    assert labels["max_lora"] == "2"
    assert labels["running_lora_adapters"] == labels["waiting_lora_adapters"] == ""
    stream = client.completions.create(
        model="chat", prompt=PROMPT, max_tokens=120, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    next(iter(stream))
    server.wait_for(lambda: _lora_info(server)["running_lora_adapters"] == "chat")
    stream.close()
    server.wait_for(lambda: _lora_info(server)["running_lora_adapters"] == "")


def _lora_info(server) -> dict[str, str] | None:
    for (name, labels), _ in server.metrics().items():
        if name == "vllm:lora_requests_info":
            return dict(labels)
    return None
