"""Chunked prefill with compression as it goes (issue 24 item 1).

The prompt is fed in chunks; after each chunk every compressed layer holds at most its budget
(plus the chunk while it is being attended): streaming methods evict by their decode rule once per
chunk, prefill-only methods score kept + new tokens with the chunk's queries. One chunk covering
the whole prompt is exactly today's one-shot prefill.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import kvhive
from kvhive.models.tiny import tiny_model, tiny_tokenizer

BUDGET = 48
PARAMETERS = {"snapkv": {"window": 4}, "pyramidkv": {"window": 4}}
METHODS = ["snapkv", "pyramidkv", "knorm", "h2o", "tova", "streamingllm", "local"]


def _model():
    torch.manual_seed(0)
    return tiny_model("llama", "gqa")


def _prompt_ids(model, length=300):
    return torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("method", METHODS)
def test_one_chunk_covering_the_prompt_is_the_one_shot_prefill(method):
    model, tokenizer = _model(), tiny_tokenizer()
    prompt = " ".join(f"word{i}" for i in range(60))
    one_shot, one_shot_cache = kvhive.generate(
        model, tokenizer, prompt, method, BUDGET, max_new_tokens=6, **PARAMETERS.get(method, {})
    )
    chunked, chunked_cache = kvhive.generate(
        model, tokenizer, prompt, method, BUDGET, max_new_tokens=6, prefill_chunk=100_000, **PARAMETERS.get(method, {})
    )
    assert chunked == one_shot
    for index in one_shot_cache.compressed_layers:
        keys, _, positions, _ = one_shot_cache.layers[index].dense()
        chunked_keys, _, chunked_positions, _ = chunked_cache.layers[index].dense()
        assert torch.equal(positions, chunked_positions)
        assert torch.equal(keys, chunked_keys)


@pytest.mark.parametrize("method", METHODS)
def test_every_chunk_leaves_at_most_the_budget(method):
    model = _model()
    ids = _prompt_ids(model)
    cache = kvhive.make_cache(model, method, BUDGET, prefill_chunk=64, **PARAMETERS.get(method, {}))
    with torch.no_grad():
        for start in range(0, ids.shape[1], 64):
            model(input_ids=ids[:, start : start + 64], past_key_values=cache)
            seen = min(ids.shape[1], start + 64)
            for index in cache.compressed_layers:
                layer = cache.layers[index]
                assert layer.tokens_seen == seen
                if seen > BUDGET:
                    budget = cache.layer_budgets[index]
                    assert layer.max_length == budget, (method, start, layer.max_length, budget)
                    if method not in ("knorm", "tova"):  # the others always keep a recent window
                        assert int(layer.dense()[2].max()) == seen - 1
    assert cache.get_seq_length() == ids.shape[1]


def test_a_chunked_prompt_continues_to_decode():
    model, tokenizer = _model(), tiny_tokenizer()
    prompt = " ".join(f"word{i}" for i in range(60))
    text, cache = kvhive.generate(
        model, tokenizer, prompt, "snapkv", BUDGET, max_new_tokens=6, prefill_chunk=32, window=4
    )
    assert isinstance(text, str) and len(text) > 0
    prompt_tokens = tokenizer(prompt, return_tensors="pt").input_ids.shape[1]
    assert cache.get_seq_length() == prompt_tokens + 5  # the last new token is not fed back
    assert all(cache.layers[i].max_length <= BUDGET + 5 for i in cache.compressed_layers)


def test_a_ratio_needs_the_whole_prompt_length():
    model = _model()
    ids = _prompt_ids(model, 200)
    cache = kvhive.make_cache(model, "snapkv", 0.2, window=4, prefill_chunk=100)
    with torch.no_grad():
        model(input_ids=ids[:, :100], past_key_values=cache)
        with pytest.raises(ValueError, match=r"ratio=0.2 was resolved on the first 100 prompt tokens.*plan_prompt"):
            model(input_ids=ids[:, 100:], past_key_values=cache)
    planned = kvhive.make_cache(model, "snapkv", 0.2, window=4)
    planned.plan_prompt(200)
    with torch.no_grad():
        model(input_ids=ids[:, :100], past_key_values=planned)
        model(input_ids=ids[:, 100:], past_key_values=planned)
    assert all(planned.layers[i].max_length == 40 for i in planned.compressed_layers)  # 0.2 of 200


def test_plan_prompt_refuses_bad_input():
    model = _model()
    cache = kvhive.make_cache(model, "snapkv", 0.2, window=4)
    with pytest.raises(ValueError, match=r"invalid prompt_length=0"):
        cache.plan_prompt(0)
    with torch.no_grad():
        model(input_ids=_prompt_ids(model, 60), past_key_values=cache)
    with pytest.raises(ValueError, match="empty cache"):
        cache.plan_prompt(200)
    with pytest.raises(ValueError, match=r"invalid prefill_chunk=0"):
        kvhive.make_cache(model, "snapkv", 32, prefill_chunk=0)


def test_head_wise_budgets_refuse_a_second_chunk():
    model = _model()
    ids = _prompt_ids(model, 200)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = kvhive.make_cache(model, "ada-snapkv", BUDGET, window=4, prefill_chunk=100)
    with torch.no_grad():
        model(input_ids=ids[:, :100], past_key_values=cache)
        if all(cache.layers[i].is_uniform for i in cache.compressed_layers):
            pytest.fail("the allocation came out uniform: this test needs head-wise counts")
        with pytest.raises(ValueError, match="cannot be scored over head-wise budgets yet"):
            model(input_ids=ids[:, 100:], past_key_values=cache)
        # Refused before anything was stored: the cache decodes on.
        assert cache.get_seq_length() == 100
        model(input_ids=ids[:, 100:101], past_key_values=cache)
    assert cache.get_seq_length() == 101


def test_without_chunked_prefill_a_continuation_is_not_compressed():
    # A multi-token forward after the prompt of a cache not made for chunks (e.g. a multiple-choice
    # answer scored over the compressed prompt) is a continuation: a prefill-only method leaves it
    # as it is, and a ratio budget resolved on the prompt is not refused.
    model = _model()
    ids = _prompt_ids(model, 200)
    cache = kvhive.make_cache(model, "snapkv", 0.2, window=4)
    with torch.no_grad():
        model(input_ids=ids[:, :150], past_key_values=cache)
        model(input_ids=ids[:, 150:], past_key_values=cache)
    assert all(cache.layers[i].max_length == 30 + 50 for i in cache.compressed_layers)  # 0.2 of 150, + 50


# ----------------------------------------------------------------------------------------------
# What a streaming method keeps after each chunk, against a brute-force reference. The reference
# recomputes every layer's queries and keys from the hidden states the layer's attention got in
# this very run (its q/k projections and RoPE), attends each chunk's queries (causally, by
# position) over the tokens the reference kept so far plus the chunk, and applies the method's rule:
#
# - H2O: every query of the chunk adds its weights to the running scores (column sums over the
#   chunk's queries, averaged over the query heads of a KV group); keep the most recent half of the
#   budget and the highest scores for the rest, per KV head;
# - TOVA: the chunk's last query's weights, averaged over every query head of the layer; keep the
#   top budget (one set per layer);
# - StreamingLLM: the first ``sink`` positions and the most recent rest.
# ----------------------------------------------------------------------------------------------

CHUNK = 100  # (at 100 the kept sets alone part when only a chunk's last query is summed)


def _capture_attention_inputs(model):
    """Per layer, the (hidden_states, cos, sin) of every forward of its attention (pre-hooks)."""
    captured: dict[int, list] = {}
    handles = []
    for index, layer in enumerate(model.model.layers):

        def hook(module, args, kwargs, index=index):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cos, sin = kwargs["position_embeddings"]
            captured.setdefault(index, []).append((hidden.detach().clone(), cos.clone(), sin.clone()))

        handles.append(layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True))
    return captured, handles


def _queries_and_keys(module, hidden, cos, sin):
    """``[Hq, n, d]`` queries and ``[H, n, d]`` keys of one forward, after RoPE, in float64."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    n = hidden.shape[1]
    d = module.head_dim
    queries = module.q_proj(hidden).view(1, n, -1, d).transpose(1, 2)
    keys = module.k_proj(hidden).view(1, n, -1, d).transpose(1, 2)
    queries, keys = apply_rotary_pos_emb(queries, keys, cos, sin)
    return queries[0].double(), keys[0].double()


class _ReferenceLayer:
    """One layer's kept positions and H2O scores, per KV head, chunk after chunk."""

    def __init__(self, method: str, heads: int, group: int, scaling: float, budget: int):
        self.method, self.heads, self.group, self.scaling, self.budget = method, heads, group, scaling, budget
        self.keys: list[torch.Tensor] = []  # [H, d] per position
        self.kept = [[] for _ in range(heads)]
        self.scores = [{} for _ in range(heads)]

    def weights(self, queries, head_of_query, stored, first):
        """Softmax weights ``[q, len(stored)]`` of one query head's chunk queries (positions
        ``first..``) over the stored positions, causal by position."""
        keys = torch.stack([self.keys[p][head_of_query // self.group] for p in stored])
        logits = queries @ keys.T * self.scaling
        query_positions = torch.arange(first, first + queries.shape[0])[:, None]
        logits = logits.masked_fill(torch.tensor(stored)[None, :] > query_positions, float("-inf"))
        return torch.softmax(logits, dim=-1)

    def feed(self, queries, keys):
        first = len(self.keys)
        self.keys.extend(keys.transpose(0, 1))  # [n, H, d] -> one [H, d] per position
        chunk = list(range(first, len(self.keys)))
        stored = [sorted(kept) + chunk for kept in self.kept]
        if self.method == "h2o":
            for head in range(self.heads):
                sums = sum(
                    self.weights(queries[q], q, stored[head], first).sum(dim=0)
                    for q in range(head * self.group, (head + 1) * self.group)
                )
                for position, value in zip(stored[head], (sums / self.group).tolist(), strict=True):
                    self.scores[head][position] = self.scores[head].get(position, 0.0) + value
        if len(stored[0]) <= self.budget:
            self.kept = stored
            return
        if self.method == "h2o":
            recent_count = self.budget - int(self.budget * 0.5)
            for head in range(self.heads):
                recent = stored[head][-recent_count:]
                rest = sorted(stored[head][:-recent_count], key=lambda p, h=head: -self.scores[h][p])
                self.kept[head] = sorted(recent + rest[: self.budget - recent_count])
        elif self.method == "tova":
            # Every KV head holds the same positions (one set per layer): the last query's weights
            # averaged over every query head.
            last = [self.weights(queries[q][-1:], q, stored[0], len(self.keys) - 1)[0] for q in range(len(queries))]
            averaged = torch.stack(last).mean(dim=0)
            top = averaged.topk(self.budget).indices.tolist()
            self.kept = [sorted(stored[0][i] for i in top)] * self.heads
        else:  # streamingllm, sink 4
            self.kept = [kept[:4] + kept[-(self.budget - 4) :] for kept in stored]


@pytest.mark.parametrize("method", ["h2o", "tova", "streamingllm"])
def test_each_chunk_keeps_what_the_method_s_rule_keeps_over_every_query_of_the_chunk(method):
    model = _model()
    ids = _prompt_ids(model)
    cache = kvhive.make_cache(model, method, BUDGET, prefill_chunk=CHUNK)
    captured, handles = _capture_attention_inputs(model)
    config = model.config
    group = config.num_attention_heads // config.num_key_value_heads
    references = {
        index: _ReferenceLayer(
            method, config.num_key_value_heads, group, model.model.layers[index].self_attn.scaling, BUDGET
        )
        for index in cache.compressed_layers
    }
    try:
        with torch.no_grad():
            for chunk, start in enumerate(range(0, ids.shape[1], CHUNK)):
                model(input_ids=ids[:, start : start + CHUNK], past_key_values=cache)
                for index, reference in references.items():
                    assert cache.layer_budgets[index] == BUDGET
                    module = model.model.layers[index].self_attn
                    reference.feed(*_queries_and_keys(module, *captured[index][chunk]))
                    _, _, positions, token_scores = cache.layers[index].dense()
                    kept = [sorted(row) for row in positions[0].tolist()]
                    assert kept == reference.kept, (method, index, chunk)
                    if method == "h2o":  # and every kept token's score counts every query so far
                        stored = token_scores["h2o_accumulated"][0].double()
                        for head, row in enumerate(positions[0].tolist()):
                            expected = torch.tensor([reference.scores[head][p] for p in row], dtype=torch.float64)
                            torch.testing.assert_close(stored[head], expected, rtol=1e-4, atol=1e-5)
    finally:
        for handle in handles:
            handle.remove()
    assert len(captured[cache.compressed_layers[0]]) == -(-ids.shape[1] // CHUNK) >= 3
