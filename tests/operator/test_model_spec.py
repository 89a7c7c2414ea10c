"""ModelShape on real public config.json files, with hand-computed sizes.

Hand computations (bf16 = 2 bytes):
- Llama-3-8B layer: q 4096*4096 + k,v 2*4096*1024 + o 4096*4096 = 41,943,040; MLP
  3*4096*14336 = 176,160,768; norms 2*4096 -> 218,112,000 per layer, * 32 layers; embeddings
  2 * 128256*4096 (untied); final norm 4096 -> 8,030,261,248. KV/token 2*32*8*128*2 = 131,072.
- SmolLM2-135M: layer 884,736 + 2,654,208 + 1,152 = 3,540,096 * 30; embeddings 49152*576 once
  (tied); final norm 576 -> 134,515,008. KV/token 2*30*3*64*2 = 23,040.
- Llama-3-70B: layer 150,994,944 + 704,643,072 + 16,384 = 855,654,400 * 80; embeddings
  2*128256*8192; final norm 8192 -> 70,553,706,496. KV/token 2*80*8*128*2 = 327,680.
- Qwen2.5-72B: as Llama with q/k/v biases (8192 + 1024 + 1024 per layer) -> 72,706,203,648.
- Mixtral-8x7B: Mistral-7B attention, 8 experts * 176,160,768 + router 8*4096 per layer ->
  46,702,792,704.
- Granite-3.3-8B: layer q,o 2*4096*4096 + k,v 2*4096*1024 = 41,943,040; MLP 3*4096*12800 =
  157,286,400; norms 8192 -> 199,237,632 * 40; embeddings 49159*4096 once (tied); final norm
  4096 -> 8,170,864,640. KV/token 2*40*8*128*2 = 163,840.
- Phi-3-mini-4k: no GQA, head_dim 96; layer qkv 3072*9216 + o 3072*3072 = 37,748,736; MLP
  3*3072*8192 = 75,497,472; norms 6144 -> 113,252,352 * 32; embeddings 2 * 32064*3072
  (untied); final norm 3072 -> 3,821,079,552. KV/token 2*32*32*96*2 = 393,216.
- Gemma-7B: heads x head_dim (16*256 = 4096) wider than hidden 3072; layer q,k,v,o 4 *
  3072*4096 = 50,331,648; MLP 3*3072*24576 = 226,492,416; norms 6144 -> 276,830,208 * 28;
  embeddings 256000*3072 once (tied by GemmaConfig's default: config.json does not say);
  final norm 3072 -> 8,537,680,896. KV/token 2*28*16*256*2 = 458,752.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpilot.engine.model_shape import (
    DTYPE_BYTES,
    SUPPORTED_ARCHITECTURES,
    ModelShape,
    UnsupportedModelError,
    check_tensor_parallel_size,
)

CONFIGS = Path(__file__).parent / "configs"


def load(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def spec(name: str) -> ModelShape:
    return ModelShape.from_hf_config(load(name))


@pytest.mark.parametrize(
    ("name", "parameters"),
    [
        ("SmolLM2-135M-Instruct", 134_515_008),
        ("Meta-Llama-3-8B", 8_030_261_248),
        ("Meta-Llama-3-70B", 70_553_706_496),
        ("Mistral-7B-v0.1", 7_241_732_096),
        ("Qwen2.5-72B-Instruct", 72_706_203_648),
        ("Mixtral-8x7B-v0.1", 46_702_792_704),
        ("granite-3.3-8b-instruct", 8_170_864_640),
        ("Phi-3-mini-4k-instruct", 3_821_079_552),
        ("gemma-7b", 8_537_680_896),
    ],
)
def test_num_parameters_of_public_models(name, parameters):
    assert spec(name).num_parameters() == parameters


def test_gemma_ties_its_embeddings_unless_the_config_says_otherwise():
    # gemma-7b's config.json has no tie_word_embeddings; GemmaConfig defaults it to true.
    assert spec("gemma-7b").tie_word_embeddings
    untied = ModelShape.from_hf_config({**load("gemma-7b"), "tie_word_embeddings": False})
    assert not untied.tie_word_embeddings
    assert untied.num_parameters() == 8_537_680_896 + 256000 * 3072
    # Other families default to untied.
    assert not ModelShape.from_hf_config(
        {k: v for k, v in load("granite-3.3-8b-instruct").items() if k != "tie_word_embeddings"}
    ).tie_word_embeddings


def test_fields_read_from_llama3_8b():
    s = spec("Meta-Llama-3-8B")
    assert (s.num_layers, s.hidden_size, s.num_attention_heads, s.num_key_value_heads) == (
        32,
        4096,
        32,
        8,
    )
    assert (s.head_dim, s.vocab_size, s.intermediate_size) == (128, 128256, 14336)
    assert s.max_position_embeddings == 8192
    assert s.architectures == ("LlamaForCausalLM",)
    assert s.model_type == "llama"
    assert not s.tie_word_embeddings and not s.qkv_bias and not s.is_moe
    assert s.torch_dtype == "bfloat16"


@pytest.mark.parametrize(
    ("name", "dtype", "tp", "kv_bytes"),
    [
        ("Meta-Llama-3-8B", "bfloat16", 1, 131_072),
        ("Meta-Llama-3-8B", "float32", 1, 262_144),
        ("Meta-Llama-3-8B", "bfloat16", 2, 65_536),
        ("Meta-Llama-3-70B", "bfloat16", 1, 327_680),
        ("Meta-Llama-3-70B", "bfloat16", 4, 81_920),
        # 16 ranks > 8 KV heads: each rank keeps one replicated head, 2*80*1*128*2.
        ("Meta-Llama-3-70B", "bfloat16", 16, 40_960),
        ("SmolLM2-135M-Instruct", "bfloat16", 1, 23_040),
        ("SmolLM2-135M-Instruct", "float32", 3, 15_360),
        ("granite-3.3-8b-instruct", "bfloat16", 1, 2 * 40 * 8 * 128 * 2),
        ("Phi-3-mini-4k-instruct", "bfloat16", 1, 2 * 32 * 32 * 96 * 2),
        ("Phi-3-mini-4k-instruct", "bfloat16", 4, 2 * 32 * 8 * 96 * 2),
        ("gemma-7b", "bfloat16", 1, 2 * 28 * 16 * 256 * 2),
        ("gemma-7b", "float32", 2, 2 * 28 * 8 * 256 * 4),
    ],
)
def test_kv_bytes_per_token(name, dtype, tp, kv_bytes):
    assert spec(name).kv_bytes_per_token(DTYPE_BYTES[dtype], tp) == kv_bytes


def test_weight_bytes_per_gpu_shards_matrices_and_replicates_norms():
    s = spec("Meta-Llama-3-8B")
    assert s.weight_bytes(2) == 2 * 8_030_261_248
    # Per rank at TP 2: embeddings 2*64128*4096; layer 8,388,608*2 + 2,097,152*2 + 88,080,384
    # + 8192 norms = 109,060,096, * 32; final norm 4096 -> 4,015,263,744 parameters.
    assert s.weight_bytes(2, tensor_parallel_size=2) == 2 * 4_015_263_744
    replicated_norms = 32 * 2 * 4096 + 4096
    assert 2 * 4_015_263_744 == 8_030_261_248 + replicated_norms


def test_tp_rule_matches_vllm():
    smol = spec("SmolLM2-135M-Instruct")  # 9 heads, 3 KV heads, 1536 MLP channels
    check_tensor_parallel_size(smol, 3)
    with pytest.raises(ValueError, match="num_attention_heads 9 is not divisible by .* 2"):
        check_tensor_parallel_size(smol, 2)
    llama70 = spec("Meta-Llama-3-70B")
    for tp in (1, 2, 4, 8, 16):
        check_tensor_parallel_size(llama70, tp)
    qwen = spec("Qwen2.5-72B-Instruct")  # 29568 = 2^7 * 231: 8 divides, 3 does not divide 64
    check_tensor_parallel_size(qwen, 8)
    with pytest.raises(ValueError, match="num_attention_heads 64"):
        check_tensor_parallel_size(qwen, 3)
    with pytest.raises(ValueError, match="positive integer"):
        check_tensor_parallel_size(qwen, 0)
    with pytest.raises(ValueError, match="intermediate_size 29568 is not divisible by .* 256"):
        check_tensor_parallel_size(
            ModelShape.from_hf_config({**load("Qwen2.5-72B-Instruct"), "num_attention_heads": 256}),
            256,
        )


def test_kv_heads_neither_dividing_is_refused():
    config = {**load("Meta-Llama-3-8B"), "num_attention_heads": 48, "num_key_value_heads": 6}
    config["head_dim"] = 128
    with pytest.raises(ValueError, match="num_key_value_heads 6 and tensor_parallel_size 4"):
        check_tensor_parallel_size(ModelShape.from_hf_config(config), 4)


def test_resolve_dtype_follows_the_engine():
    assert spec("Meta-Llama-3-8B").resolve_dtype("auto") == "bfloat16"
    fp32 = ModelShape.from_hf_config({**load("Meta-Llama-3-8B"), "torch_dtype": "float32"})
    assert fp32.resolve_dtype("auto") == "bfloat16"
    assert fp32.resolve_dtype("auto", device="cpu") == "float32"
    fp16 = ModelShape.from_hf_config({**load("Meta-Llama-3-8B"), "torch_dtype": "float16"})
    assert fp16.resolve_dtype("auto") == "float16"
    assert fp32.resolve_dtype("half") == "float16"
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        fp32.resolve_dtype("int8")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": None}, "missing 'hidden_size'"),
        ({"num_hidden_layers": 0}, "'num_hidden_layers' must be a positive integer, got 0"),
        ({"vocab_size": "big"}, "'vocab_size' must be a positive integer"),
        ({"num_attention_heads": 30}, "hidden_size 4096 is not divisible by .* 30"),
        (
            {"num_attention_heads": 30, "head_dim": 128},
            "num_attention_heads 30 is not a multiple of num_key_value_heads 8",
        ),
    ],
)
def test_malformed_configs_name_the_key(change, message):
    config = {**load("Meta-Llama-3-8B"), **change}
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        ModelShape.from_hf_config(config)


@pytest.mark.parametrize(
    ("extra", "error", "words"),
    [
        # MLA needs its head sizes; an MoE layout needs its expert width.
        ({"kv_lora_rank": 512}, ValueError, "missing 'qk_nope_head_dim'"),
        ({"num_experts": 60}, UnsupportedModelError, "without moe_intermediate_size"),
        ({"n_routed_experts": 64}, UnsupportedModelError, "without moe_intermediate_size"),
    ],
)
def test_unmodelled_layouts_are_refused(extra, error, words):
    with pytest.raises(error, match=words):
        ModelShape.from_hf_config({**load("Meta-Llama-3-8B"), **extra})


def test_text_config_of_a_multimodal_config_is_read():
    config = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava"}
    config["text_config"] = load("Mistral-7B-v0.1")
    s = ModelShape.from_hf_config(config)
    assert s.num_layers == 32 and s.vocab_size == 32000
    assert s.architectures == ("LlavaForConditionalGeneration",)


TINY = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 256,
}


# DeepSeek's MLA and MoE at tiny sizes: the first layer dense, then 8 experts and a shared one.
DEEPSEEK_MLA = {
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,
    "num_key_value_heads": 4,
}


@pytest.mark.parametrize(
    ("model_type", "extra"),
    [
        ("llama", {"attention_bias": True, "mlp_bias": True}),
        ("llama", {"tie_word_embeddings": True, "head_dim": 32}),
        ("qwen2", {}),
        ("qwen3", {"head_dim": 8, "attention_bias": False}),
        ("qwen3", {"head_dim": 16, "attention_bias": True}),
        ("mistral", {}),
        ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
        ("granite", {"attention_bias": True, "mlp_bias": True}),
        ("phi3", {"pad_token_id": 0}),
        ("gemma", {"head_dim": 32}),
        ("gemma", {"head_dim": 8, "tie_word_embeddings": True}),
        ("qwen3_moe", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
        # Layer 1 dense by mlp_only_layers; a dense MLP of intermediate_size there.
        (
            "qwen3_moe",
            {"num_experts": 8, "moe_intermediate_size": 32, "mlp_only_layers": [1], "head_dim": 16},
        ),
        # A shared expert with its sigmoid gate; every second layer sparse.
        (
            "qwen2_moe",
            {
                "num_experts": 8,
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 48,
                "decoder_sparse_step": 2,
            },
        ),
        ("deepseek_v3", {**DEEPSEEK_MLA, "q_lora_rank": 24, "n_group": 2, "topk_group": 1}),
        ("deepseek_v2", {**DEEPSEEK_MLA, "q_lora_rank": None, "n_shared_experts": 2}),
    ],
)
def test_num_parameters_matches_transformers(model_type, extra):
    """The count equals the parameters of transformers' own module on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = {"model_type": model_type, "tie_word_embeddings": False, **TINY, **extra}
    hf_config = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    expected = sum(p.numel() for p in model.parameters())
    ours = ModelShape.from_hf_config({k: v for k, v in config.items() if v is not None})
    assert ours.num_parameters() == expected
    assert ours.weight_bytes(2) == 2 * expected


@pytest.mark.parametrize(
    ("rope", "derived"),
    [
        (None, 32768),
        ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072),
        ({"rope_type": "linear", "factor": 2.0}, 65536),
        ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}, 32768),
    ],
)
def test_derived_max_model_len_follows_rope_scaling(rope, derived):
    config = {**load("Qwen2.5-72B-Instruct"), "rope_scaling": rope}
    assert ModelShape.from_hf_config(config).derived_max_model_len == derived


def test_supported_architectures_are_the_engines():
    from kvpilot.engine.models import MODEL_REGISTRY

    assert set(MODEL_REGISTRY) == SUPPORTED_ARCHITECTURES


def test_engine_support():
    assert spec("Meta-Llama-3-8B").is_supported_by_engine
    assert spec("Qwen2.5-72B-Instruct").is_supported_by_engine
    for name in ("granite-3.3-8b-instruct", "Phi-3-mini-4k-instruct", "gemma-7b"):
        assert spec(name).is_supported_by_engine
        assert ModelShape.from_hf_config(
            {**load(name), "architectures": None}
        ).is_supported_by_engine
    assert spec("Mixtral-8x7B-v0.1").is_supported_by_engine
    awq = {**load("Mistral-7B-v0.1"), "quantization_config": {"quant_method": "awq", "bits": 4}}
    assert ModelShape.from_hf_config(awq).quantization_method == "awq"
    assert ModelShape.from_hf_config(awq).is_supported_by_engine
    bnb = {**awq, "quantization_config": {"quant_method": "bitsandbytes"}}
    assert not ModelShape.from_hf_config(bnb).is_supported_by_engine
    # transformers' configs built from GGUF metadata carry model_type but no architectures.
    gguf_like = {**load("SmolLM2-135M-Instruct"), "architectures": None}
    assert ModelShape.from_hf_config(gguf_like).is_supported_by_engine


@pytest.mark.parametrize(
    ("quantization", "words"),
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes' is not supported"),
        ({"quant_method": "gguf"}, "'gguf' is not supported"),
        ({"quant_method": "awq", "bits": 3}, "awq with 3 bits is not supported"),
    ],
)
def test_unsupported_quantization_is_named(quantization, words):
    shape = ModelShape.from_hf_config(
        {**load("Mistral-7B-v0.1"), "quantization_config": quantization}
    )
    assert not shape.is_supported_by_engine
    assert words in shape.engine_support_error()
    assert "fp8, compressed-tensors, awq, gptq" in shape.engine_support_error() or "bits" in words


def test_moe_total_and_active_parameters_of_public_models():
    # Qwen3-30B-A3B: per layer attention 2048*4096*2 + 2048*512*2 + q/k norms 256, 128 experts
    # of 3*2048*768, router 128*2048, norms 4096; embeddings 2*151936*2048; final norm.
    qwen = spec("Qwen3-30B-A3B")
    assert (
        qwen.moe_intermediate_size,
        qwen.dense_layers,
        qwen.shared_expert_intermediate_size,
    ) == (
        768,
        (),
        0,
    )
    attention = 2048 * 4096 * 2 + 2048 * 512 * 2 + 256
    rest = 128 * 2048 + 4096
    embeddings = 2 * 151936 * 2048 + 2048
    assert qwen.num_parameters() == 48 * (attention + 128 * 3 * 2048 * 768 + rest) + embeddings
    assert qwen.num_active_parameters() == 48 * (attention + 8 * 3 * 2048 * 768 + rest) + embeddings
    assert (
        round(qwen.num_parameters() / 1e9, 1),
        round(qwen.num_active_parameters() / 1e9, 1),
    ) == (
        30.5,
        3.4,
    )
    # Dense models: every parameter is active.
    assert spec("Meta-Llama-3-8B").num_active_parameters() == 8_030_261_248


def test_deepseek_v3_is_sized_with_mla_and_block_fp8():
    """DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json): 671B parameters (37.6B active), its
    KV cache one 512 + 64 latent per token and layer, weights in fp8 with 128x128 block scales.
    Sized for planning, though the engine does not run it."""
    ds = spec("DeepSeek-V3")
    assert (ds.num_parameters(), ds.num_active_parameters()) == (671_026_404_352, 37_552_282_624)
    assert ds.dense_layers == (0, 1, 2) and ds.shared_expert_intermediate_size == 2048
    # (kv_lora_rank 512 + qk_rope_head_dim 64) * 61 layers * 2 bytes, the same on every rank.
    assert ds.kv_bytes_per_token(2) == ds.kv_bytes_per_token(2, 8) == 576 * 61 * 2 == 70_272
    assert ds.kv_bytes_per_token(1) == 35_136  # fp8
    assert ds.quantization.description == "fp8 float8, block 128x128"
    assert "'DeepseekV3ForCausalLM' is not implemented" in ds.engine_support_error()


@pytest.mark.parametrize(
    ("layers", "pp", "sizes"),
    # vLLM's get_pp_indices: num_layers // pp each, the remainder on the stages before the last.
    [(126, 2, [63, 63]), (61, 4, [15, 15, 16, 15]), (32, 3, [11, 11, 10]), (80, 1, [80])],
)
def test_pipeline_stages_split_layers_as_vllm(layers, pp, sizes):
    model = ModelShape.from_hf_config({**load("Meta-Llama-3-70B"), "num_hidden_layers": layers})
    stages = model.pipeline_stage_layers(pp)
    assert [len(stage) for stage in stages] == sizes
    assert [stage.start for stage in stages] == [sum(sizes[:i]) for i in range(pp)]
    kv = [
        model.kv_bytes_per_token(2, 8, pipeline_parallel_size=pp, pipeline_rank=r)
        for r in range(pp)
    ]
    assert kv == [2 * n * 1 * 128 * 2 for n in sizes]
    with pytest.raises(
        ValueError, match="pipeline_parallel_size must be an integer in 1..num_layers"
    ):
        model.pipeline_stage_layers(layers + 1)


def test_pipeline_stages_hold_the_embedding_first_and_the_head_last():
    model = spec("SmolLM2-135M-Instruct")  # tied embeddings: the last stage keeps its own copy
    first = model.weight_bytes(2, pipeline_parallel_size=2, pipeline_rank=0)
    last = model.weight_bytes(2, pipeline_parallel_size=2, pipeline_rank=1)
    layer = 3_540_096
    assert first == 2 * (15 * layer + 49152 * 576)
    assert last == 2 * (15 * layer + 49152 * 576 + 576)
    assert first + last == model.weight_bytes(2) + 2 * 49152 * 576


def test_moe_tensor_parallel_rule_names_the_expert_width():
    qwen = spec("Qwen3-30B-A3B")  # moe_intermediate_size 768 = 2^8 * 3
    check_tensor_parallel_size(qwen, 4)
    with pytest.raises(ValueError, match="moe_intermediate_size 768 is not divisible by .* 5"):
        check_tensor_parallel_size(
            ModelShape.from_hf_config({**load("Qwen3-30B-A3B"), "num_attention_heads": 40}), 5
        )
