"""Default sampling from a model's generation_config.json (vLLM's ``--generation-config``)."""

import json
import shutil

import pytest

from kvpilot.engine.llm import LLM
from kvpilot.engine.model_loader.generation_config import read_sampling_defaults
from kvpilot.engine.model_loader.resolve import DEFAULT_MODEL_SAMPLING
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.server.protocol import CompletionRequest


def write_config(folder, **values):
    folder.mkdir(exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **values}))
    return folder


def test_only_the_sampling_keys_the_file_sets_are_read(tmp_path):
    folder = write_config(tmp_path / "m", temperature=0.6, top_p=0.95, top_k=None, do_sample=True)
    assert read_sampling_defaults(folder) == {"temperature": 0.6, "top_p": 0.95}
    assert read_sampling_defaults(folder, "vllm") == {}
    other = write_config(tmp_path / "other", repetition_penalty=1.1, min_p=0.05)
    assert read_sampling_defaults(folder, str(other)) == {"repetition_penalty": 1.1, "min_p": 0.05}


def test_a_model_without_a_file_has_no_defaults_and_a_missing_folder_is_refused(tmp_path):
    assert read_sampling_defaults(tmp_path) == {}
    with pytest.raises(ValueError, match="generation_config: .* does not exist"):
        read_sampling_defaults(tmp_path, str(tmp_path / "absent"))


def test_the_default_model_carries_its_model_cards_sampling(default_model_dir):
    assert (
        read_sampling_defaults(default_model_dir)
        == DEFAULT_MODEL_SAMPLING
        == {
            "temperature": 0.2,
            "top_p": 0.9,
        }
    )


def test_unset_request_fields_take_the_defaults_and_set_ones_win():
    defaults = SamplingParams(temperature=0.2, top_p=0.9)
    unset = CompletionRequest(model="m", prompt="x").to_sampling_params(16, None, 100, defaults)
    assert (unset.temperature, unset.top_p, unset.top_k) == (0.2, 0.9, 0)
    given = CompletionRequest(model="m", prompt="x", temperature=1.0, top_p=1.0)
    params = given.to_sampling_params(16, None, 100, defaults)
    assert (params.temperature, params.top_p) == (1.0, 1.0)


def test_the_engine_samples_with_the_models_defaults(tiny_model_dir, tmp_path):
    """A model whose generation config says temperature 0 decodes greedily when the request
    says nothing; ``--generation-config vllm`` goes back to the engine's temperature 1."""
    folder = tmp_path / "greedy-model"
    shutil.copytree(tiny_model_dir("llama"), folder)
    write_config(folder, temperature=0.0)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    llm = LLM(str(folder), max_model_len=64)
    assert llm.get_default_sampling_params().temperature == 0.0
    greedy = llm.generate([prompt], SamplingParams(temperature=0.0))[0].outputs[0].token_ids
    assert llm.generate([prompt])[0].outputs[0].token_ids == greedy
    engine_defaults = LLM(str(folder), max_model_len=64, generation_config="vllm")
    assert engine_defaults.get_default_sampling_params().temperature == 1.0


def test_max_new_tokens_is_the_default_output_limit(tiny_model_dir, tmp_path):
    """As vLLM reads it: the generation config's ``max_new_tokens`` limits requests that set no
    limit, offline (the default ``SamplingParams``) and on the server (chat's unset
    ``max_tokens``, cut to the context left)."""
    from kvpilot.engine.engine_core import EngineCoreInfo
    from kvpilot.engine.server.serving_engine import OpenAIServing

    folder = tmp_path / "short-model"
    shutil.copytree(tiny_model_dir("llama"), folder)
    write_config(folder, max_new_tokens=5, temperature=0.0)
    assert read_sampling_defaults(folder) == {"temperature": 0.0, "max_tokens": 5}
    llm = LLM(str(folder), max_model_len=64)
    [out] = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 5
    info = EngineCoreInfo.from_engine(llm.llm_engine)
    assert info.default_max_tokens == 5
    serving = OpenAIServing(None, None, ["m"], 64, 100, default_max_tokens=5)
    assert serving.max_tokens_for(10, None, "messages") == 5
    assert serving.max_tokens_for(62, None, "messages") == 2  # the context left
    assert serving.max_tokens_for(10, 30, "messages") == 30  # a request's own limit wins
    assert OpenAIServing(None, None, ["m"], 64, 100).max_tokens_for(10, None, "messages") == 54


def test_max_new_tokens_of_the_overrides_or_a_config_folder_caps_every_request(
    tiny_model_dir, tmp_path
):
    """vLLM's ``override_max_tokens``: ``--override-generation-config``'s ``max_new_tokens``
    (with ``auto`` or ``vllm``), or a ``--generation-config`` folder's, caps a request's own
    limit too; the model's own file (``auto``) only sets the default."""
    from kvpilot.engine.engine_core import EngineCoreInfo
    from kvpilot.engine.server.serving_engine import OpenAIServing

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), folder)
    write_config(folder, max_new_tokens=9)
    elsewhere = tmp_path / "config-folder"
    elsewhere.mkdir()
    write_config(elsewhere, max_new_tokens=7)

    def caps(**kwargs) -> EngineCoreInfo:
        return EngineCoreInfo.from_engine(LLM(str(folder), max_model_len=64, **kwargs).llm_engine)

    assert caps().override_max_tokens is None
    overridden = caps(override_generation_config={"max_new_tokens": 4})
    assert (overridden.default_max_tokens, overridden.override_max_tokens) == (4, 4)
    only_overrides = caps(
        generation_config="vllm", override_generation_config={"max_new_tokens": 3}
    )
    assert only_overrides.override_max_tokens == 3
    assert caps(generation_config=str(elsewhere)).override_max_tokens == 7
    serving = OpenAIServing(None, None, ["m"], 64, 100, override_max_tokens=4)
    assert serving.max_tokens_for(10, 30, "prompt") == 4  # a larger request is cut
    assert serving.max_tokens_for(10, 2, "prompt") == 2
    assert serving.max_tokens_for(62, None, "prompt") == 2  # the context left is less
