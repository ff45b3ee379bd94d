"""Summarise a mutmut run over kvhive/methods/ (scripts/mutation.sh) as markdown: mutants per module
by status, and each surviving mutant with the function it lives in and its one-line change.

Reads mutmut's own result files (``mutants/**/*.meta``) and asks ``mutmut show`` for each survivor's
diff, so the numbers are mutmut's. Usage: ``python scripts/mutation_summary.py > results/mutation/summary.md``.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import tomllib

# mutmut's exit-code meanings (mutmut.stats.status_by_exit_code, mutmut 3.8): a timeout is 36 or a
# CPU-limit signal (SIGXCPU: -24, 24, 152; 255), which scripts/mutation.sh's watchdog also sends.
STATUS = {
    1: "killed",
    3: "killed",
    0: "survived",
    5: "no tests",
    33: "no tests",
    None: "not checked",
    36: "timeout",
    -24: "timeout",
    24: "timeout",
    152: "timeout",
    255: "timeout",
}
COLUMNS = ("killed", "survived", "no tests", "timeout", "not checked", "other")


def load(root: Path) -> dict[str, dict[str, str]]:
    by_module: dict[str, dict[str, str]] = {}
    for meta in sorted(root.glob("kvhive/methods/*.py.meta")):
        codes = json.loads(meta.read_text()).get("exit_code_by_key", {})
        by_module[meta.name.removesuffix(".meta")] = {key: STATUS.get(code, "other") for key, code in codes.items()}
    return by_module


# Written reasons for survivors that are not paper elements, by the shape of the change.
REASONS = (
    ("device=", "equivalent on CPU: only the tensor's device changes"),
    ('"-INF"', 'equivalent: float("-INF") is float("-inf")'),
    ("XX", "message or key text only (a ValueError's wording, a statistics key)"),
    ("raise ValueError(None)", "message text only: the error is still raised"),
    ('float("INF")', 'equivalent: float("INF") is float("inf")'),
    (
        '"policy_state", None)',
        "equivalent for a KVHiveCache: every LayerStore has policy_state (the default serves other caches only)",
    ),
    (
        '"policy_state", )',
        "equivalent for a KVHiveCache: every LayerStore has policy_state (the default serves other caches only)",
    ),
)
FUNCTION_REASONS = (
    ("describe", "`kvhive methods` listing text"),
    ("__repr__", "repr text"),
    ("_too_small", "error message wording (the error itself is tested)"),
)


# Survivors reviewed by hand (mutant name -> verdict): a test that now kills it (checked by applying
# the change by hand) or why it cannot change a result.
_KILLED_ADAKV_REFERENCE = "killed by tests/methods/test_adakv_allocation_reference.py (applied by hand)"
_NO_ROOM = (
    "equivalent: the settlement's no-room guard never binds (a head's target is below its candidates; "
    "exhaustive search over H <= 5, M <= 9, every owned-count vector, 14 alphas)"
)
REVIEWED = {
    **{
        f"kvhive.methods.adakv.x_adaptive_allocation__mutmut_{n}": _KILLED_ADAKV_REFERENCE
        for n in (3, 4, 5, 6, 9, 10, 11, 12, 61)
    },
    "kvhive.methods.adakv.x_adaptive_allocation__mutmut_2": "equivalent: at budget == candidates the general path keeps everything too",
    "kvhive.methods.adakv.x_adaptive_allocation__mutmut_7": "equivalent: at budget 0 the general path keeps nothing (floor 0, adaptive 0)",
    "kvhive.methods.adakv.x_adaptive_allocation__mutmut_36": "equivalent on CPU: only the tensor's device changes",
    "kvhive.methods.adakv.x_adaptive_allocation__mutmut_42": "equivalent: a zero safeguard count selects nothing either way",
    "kvhive.methods.adakv.x_adaptive_allocation__mutmut_60": "equivalent: a zero adaptive count selects nothing either way",
    "kvhive.methods.adakv.x_adaptive_allocation__mutmut_98": "equivalent: dim +1 of a 2-D tensor is dim -1",
    **{
        f"kvhive.methods.adakv.x_authors_head_budgets__mutmut_{n}": _KILLED_ADAKV_REFERENCE
        for n in (46, 67, 73, 77, 85, 87)
    },
    "kvhive.methods.adakv.x_authors_head_budgets__mutmut_35": "equivalent on CPU: only the tensor's device changes",
    "kvhive.methods.adakv.x_authors_head_budgets__mutmut_42": "equivalent: dim +1 of a 2-D tensor is dim -1",
    "kvhive.methods.adakv.x_authors_head_budgets__mutmut_68": "equivalent: inside `while missing != 0`, missing is never 0",
    "kvhive.methods.adakv.x_authors_head_budgets__mutmut_71": (
        "equivalent: a step of -2 overshoots and the next round gives the unit back to the same head "
        "(same budgets on every instance of the exhaustive search)"
    ),
    **{f"kvhive.methods.adakv.x_authors_head_budgets__mutmut_{n}": _NO_ROOM for n in (74, 75, 78)},
    "kvhive.methods.adakv.x_authors_head_budgets__mutmut_76": "equivalent: step is never 0",
    "kvhive.methods.adakv.x_authors_head_budgets__mutmut_79": (
        "equivalent: no head at 1 is ever next in line to lose a unit (exhaustive search as for the no-room guard)"
    ),
    "kvhive.methods.adakv.x_authors_head_budgets__mutmut_81": "equivalent: step is +1 or -1, so / step is * step",
    "kvhive.methods.adakv.x_keep_head_budgets__mutmut_2": _KILLED_ADAKV_REFERENCE,
    "kvhive.methods.adakv.x_keep_head_budgets__mutmut_16": "equivalent: slicing [:None] is the whole order, as [:M]",
    "kvhive.methods.adakv.x_keep_head_budgets__mutmut_25": "equivalent on CPU: only the tensor's device changes",
    **{
        f"kvhive.methods.adakv.xǁAdaKVǁ_keep_with_protected__mutmut_{n}": _KILLED_ADAKV_REFERENCE
        for n in (26, 27, 30, 38, 43, 48)
    },
    **{
        f"kvhive.methods.adakv.xǁAdaKVǁ_keep_with_protected__mutmut_{n}": (
            "equivalent: allocate treats rows independently and only chosen[0], the row's own, is read"
        )
        for n in (20, 22)
    },
}
_KILLED_AHAKV_EDGES = "killed by tests/methods/test_ahakv_edges.py (applied by hand)"
_AHAKV = "kvhive.methods.ahakv."
REVIEWED.update(
    {
        **{
            _AHAKV + name: _KILLED_AHAKV_EDGES
            for name in (
                "x_sg_lambda__mutmut_1",
                "x_sg_lambda__mutmut_2",
                *(f"x_sg_logit_multiplier__mutmut_{n}" for n in (3, 4, 13, 14, 15, 20, 23, 25)),
                "x_row_padding__mutmut_2",
                "x_row_padding__mutmut_3",
                "x_ahakv_scores__mutmut_19",
                "xǁAhaKVǁscore__mutmut_2",
                "xǁAhaKVǁscore__mutmut_8",
                "xǁAhaKVǁscore__mutmut_9",
            )
        },
        _AHAKV + "x_sg_lambda__mutmut_7": "equivalent: at n == k, sqrt(2 ln(n/k) / d) is 0 as the early return",
        _AHAKV + "x_row_padding__mutmut_10": "equivalent: dim +1 of the [B, N] count is dim -1",
        _AHAKV + "x__scoring_multiplier__mutmut_19": (
            "equivalent: a tuple of equal factors scales every row by the same number as the single factor"
        ),
        _AHAKV + "x_ahakv_scores__mutmut_1": "equivalent: every caller passes recent and kernel",
        _AHAKV + "x_ahakv_scores__mutmut_2": "equivalent: every caller passes recent and kernel",
        _AHAKV + "x_value_prior__mutmut_14": "equivalent: torch.stack promotes the boolean weight to the norms' dtype",
        _AHAKV + "x_value_prior__mutmut_17": "equivalent: a mean filter of one tap is the identity",
        _AHAKV + "x_value_prior__mutmut_18": "equivalent: the kernel is validated odd, so kernel 2 never occurs",
        _AHAKV + "x_value_prior__mutmut_44": "equivalent: count_include_pad=True is avg_pool1d's default",
        _AHAKV + "x_value_prior__mutmut_48": (
            "equivalent: the prior is a ratio of two pooled sums with the same count, which cancels"
        ),
        _AHAKV + "xǁAhaKVǁ_layer_budget__mutmut_2": "equivalent: the cache always passes a layer budget",
        _AHAKV + "xǁAhaKVǁinitialize_decode__mutmut_2": "equivalent: the cache always passes a layer budget",
        _AHAKV + "xǁAhaKVǁobserve_decode__mutmut_10": "equivalent: the cache always passes a layer budget",
        _AHAKV + "xǁAhaKVǁobserve_decode__mutmut_25": (
            "equivalent in the tests' fp32: the running score is already in the attention's dtype"
        ),
        **{
            _AHAKV + f"xǁAhaKVǁscore__mutmut_{n}": (
                "equivalent in results: the prefill is always treated as stale and re-scored (same scores, more work)"
            )
            for n in (5, 7, 22, 24)
        },
    }
)

# Survivors of the session of 2026-11-24 (third stop), each kill checked by applying the change by hand.
_TEST_PARAMETERS = "tests/methods/test_method_parameters.py"
_ZERO_STATE = (
    f"killed by {_TEST_PARAMETERS}::test_a_layer_without_policy_state_reports_zero_state_bytes (applied by hand)"
)
_M = "kvhive.methods."
REVIEWED.update(
    {
        **{
            _M + f"subgen_attention.xǁStreamingStructuresǁtoken_equivalents__mutmut_{n}": (
                "killed by tests/methods/test_subgen.py::test_token_equivalents_count_the_vectors_each_row_holds (applied by hand)"
            )
            for n in (1, 3, 4, 6)
        },
        _M + "subgen_attention.xǁSubGenAttentionǁstate_nbytes__mutmut_3": _ZERO_STATE,
        _M + "subgen_attention.xǁSubGenAttentionǁstate_nbytes__mutmut_5": _ZERO_STATE,
        _M + "bumblebee.xǁBumbleBeeǁstate_nbytes__mutmut_3": _ZERO_STATE,
        _M + "bumblebee.xǁBumbleBeeǁstate_nbytes__mutmut_5": _ZERO_STATE,
        _M + "base.xǁPolicyǁstate_nbytes__mutmut_1": _ZERO_STATE,
        _M + "base.xǁPolicyǁminimum_budget__mutmut_1": (
            f"killed by {_TEST_PARAMETERS}::test_methods_without_a_fixed_window_honour_a_one_token_cache (applied by hand)"
        ),
        _M + "subgen_attention.x_structures_nbytes__mutmut_2": (
            "killed by tests/methods/test_subgen.py::test_prefill_and_50_decode_steps_keep_exact_budgets (bytes = sum over layers)"
        ),
        _M + "subgen_attention.x_structures_nbytes__mutmut_14": (
            "killed by tests/methods/test_subgen.py::test_prefill_and_50_decode_steps_keep_exact_budgets (bytes = sum over layers)"
        ),
        _M + "subgen_attention.x_clustering_statistics__mutmut_18": (
            "killed by tests/methods/test_subgen.py::test_prefill_and_50_decode_steps_keep_exact_budgets (gemma3: sliding layers first)"
        ),
        _M + "subgen_attention.x_clustering_statistics__mutmut_15": (
            "equivalent: the structures and the plan are stored together (both or neither)"
        ),
        _M
        + "subgen.x__padded_indices__mutmut_7": "killed by tests/methods/test_subgen.py::test_padded_indices_lists_each_rows_true_columns_in_order (applied by hand)",
        _M
        + "subgen.x__padded_indices__mutmut_9": "killed by tests/methods/test_subgen.py::test_padded_indices_lists_each_rows_true_columns_in_order (applied by hand)",
        _M
        + "subgen.x__padded_indices__mutmut_21": "killed by tests/methods/test_subgen.py::test_padded_indices_lists_each_rows_true_columns_in_order (3,000-column rows; applied by hand)",
        **{
            _M + f"subgen.x__padded_indices__mutmut_{n}": (
                "killed by tests/methods/test_subgen.py::test_padded_indices_lists_each_rows_true_columns_in_order "
                "(an unstable sort, as stable=False; applied by hand)"
            )
            for n in (13, 16)
        },
        _M + "subgen.x__padded_indices__mutmut_3": "equivalent: dim +1 of the [R, N] mask is dim -1",
        _M + "subgen.x__padded_indices__mutmut_15": "equivalent: torch.sort sorts the last dimension by default",
        _M + "subgen.x__padded_indices__mutmut_19": "equivalent: dim +1 of the [R, N] mask is dim -1",
        _M + "subgen.x__squared_distances__mutmut_19": (
            "killed by tests/methods/test_subgen.py::test_decode_evicts_the_newer_member_of_the_closest_pair_hand_checked (keys at 1/100 scale; applied by hand)"
        ),
        **{
            _M + f"submodular.xǁStreamingSummaryǁconcatenate__mutmut_{n}": (
                "killed by tests/methods/test_bumblebee.py::test_prefill_in_chunks_of_rows_equals_one_chunk (2 and 6 parts)"
            )
            for n in (1, 2, 4, 5, 6, 7, 8, 10, 11, 12, 13, 14)
        },
        _M
        + "submodular.xǁStreamingSummaryǁconcatenate__mutmut_9": "equivalent: torch.cat joins along dim 0 by default",
        **{
            _M + f"random_local.xǁRandomLocalǁ_priorities__mutmut_{n}": (
                "equivalent: one generator per batch row and one count per row: the lengths always agree (strict only guards)"
            )
            for n in (26, 29, 34)
        },
        _M
        + "random_local.xǁRandomLocalǁ_priorities__mutmut_38": "equivalent: float32 is torch's default dtype (kvhive never changes it)",
        _M
        + "random_local.xǁRandomLocalǁ_priorities__mutmut_41": "equivalent: float32 is torch's default dtype (kvhive never changes it)",
        **{
            _M + f"random_local.xǁRandomLocalǁ_priorities__mutmut_{n}": (
                "equivalent in distribution: every real token still gets an i.i.d. uniform priority above 0, "
                "so the kept random tokens are a uniformly random subset either way"
            )
            for n in (44, 45)
        },
        _M + "h2o.xǁH2Oǁscore__mutmut_3": "equivalent: H2O.initialize_decode does not read the state",
        _M + "h2o.xǁH2Oǁobserve_decode__mutmut_4": "equivalent: an in-place add casts into the running score's dtype",
    }
)

_EXACT_BLOCKS = (
    "equivalent in results: block and pool sizes only decide when the exact distances are refreshed "
    "(test_blocked_farthest_point_equals_the_plain_algorithm: blocks 1-32, pools 1-128 equal the plain algorithm)"
)
_NEAREST_BLOCKS = "equivalent in results: the column blocks only bound memory; overlapping or larger blocks recompute the same distances"
_EDGES = "killed by tests/methods/test_subgen.py::test_farthest_point_order_edges_scale_exhausted_rows_one_center_no_rows (applied by hand)"
_SEED_MESSAGE = "killed by tests/methods/test_method_parameters.py::test_seed_accepts_exactly_the_range_a_torch_generator_takes (applied by hand)"
_SEED_CONSTANTS = (
    "equivalent: another injective map of (seed, layer, head) to a generator seed; the particular random stream "
    "is not a paper element (each draw is still i.i.d. uniform)"
)
_SUBGEN = "kvhive.methods.subgen."
REVIEWED.update(
    {
        **{f"kvhive.methods.base.x_derived_seed__mutmut_{n}": _SEED_CONSTANTS for n in (2, 4, 7, 9)},
        **{f"kvhive.methods.base.x_require_seed__mutmut_{n}": _SEED_MESSAGE for n in (5, 6, 18)},
        **{_SUBGEN + f"x__nearest_among__mutmut_{n}": _NEAREST_BLOCKS for n in (7, 13, 14, 20, 24, 25, 26)},
        **{_SUBGEN + f"x_farthest_point_order__mutmut_{n}": _EXACT_BLOCKS for n in (1, 2, 63, 69, 134, 204, 205, 207)},
        **{_SUBGEN + f"x_farthest_point_order__mutmut_{n}": _EDGES for n in (22, 30, 119, 273, 274)},
        _SUBGEN
        + "x_farthest_point_order__mutmut_28": "equivalent: with no rows the loop has nothing to update (shape (0, count) either way)",
        **{
            _SUBGEN
            + f"x_farthest_point_order__mutmut_{n}": "equivalent: dim +1 of a 2-D [rows, points] tensor is dim -1"
            for n in (18, 140, 190, 201, 215)
        },
        _SUBGEN + "x_farthest_point_order__mutmut_139": "equivalent: topk takes the last dimension by default",
        **{
            _SUBGEN + f"x_farthest_point_order__mutmut_{n}": "equivalent on CPU: only the tensor's device changes"
            for n in (4, 13, 41, 155, 267)
        },
        _SUBGEN + "x__padded_indices__mutmut_26": "equivalent on CPU: only the tensor's device changes",
        **{
            f"kvhive.methods.adakv.x_allocate__mutmut_{n}": (
                "killed by tests/methods/test_adakv_allocation_reference.py (early exits, budget 1, the padded protected-sinks "
                "path; applied by hand; that file is outside [tool.mutmut]'s test selection, see the header)"
            )
            for n in (4, 5, 6, 7, 9, 18, 22, 25, 28)
        },
        "kvhive.methods.adakv.x_allocate__mutmut_1": "equivalent: at budget == candidates the general path keeps everything too",
        "kvhive.methods.adakv.x_allocate__mutmut_8": "equivalent: budget 0 allocates nothing on the general path too",
        "kvhive.methods.base.x_require_seed__mutmut_17": _SEED_MESSAGE,
        **{
            f"kvhive.methods.adakv.x__protected_window__mutmut_{n}": (
                "killed by tests/methods/test_adakv.py::test_protected_window_recognises_exactly_a_trailing_window_in_every_head "
                "(applied by hand)"
            )
            for n in (2, 4, 5, 6, 9, 11, 12, 13, 15)
        },
        **{
            name: (
                "killed by tests/cache/test_ratio_rows.py::test_prefill_only_method_gives_each_row_its_own_share "
                "(padded rows; applied by hand; that file is outside [tool.mutmut]'s test selection)"
            )
            for name in (
                "kvhive.methods.adakv.x_ada_keep__mutmut_21",
                "kvhive.methods.adakv.x_ada_keep__mutmut_26",
                "kvhive.methods.adakv.x_ada_keep__mutmut_29",
                "kvhive.methods.adakv.xǁAdaKVǁselect_prefill__mutmut_41",
            )
        },
        **{
            f"kvhive.methods.subgen.xǁSubGenǁselect_decode__mutmut_{n}": (
                "equivalent in results: without the ready flags every candidate counts as new and its nearest "
                "neighbour is recomputed exactly (more work, same evictions)"
            )
            for n in (37, 38, 39, 40, 42, 46)
        },
        **{
            f"kvhive.methods.subgen.xǁSubGenǁselect_decode__mutmut_{n}": "equivalent on CPU: only the tensor's device changes"
            for n in (7, 17, 20, 33, 36, 50, 53)
        },
        "kvhive.methods.subgen.xǁSubGenǁselect_prefill__mutmut_5": (
            "equivalent in results: the farthest-point order is greedy, so extra centers rank below the first "
            "budget - recent and are not kept (more work)"
        ),
        "kvhive.methods.subgen.xǁSubGenǁselect_prefill__mutmut_65": "equivalent: the scratch column only absorbs the -1 indices and is cut off",
        **{
            f"kvhive.methods.subgen.xǁSubGenǁselect_prefill__mutmut_{n}": "equivalent: float32 is torch's default dtype (kvhive never changes it)"
            for n in (32, 36)
        },
        **{
            f"kvhive.methods.subgen.xǁSubGenǁselect_prefill__mutmut_{n}": "equivalent on CPU: only the tensor's device changes"
            for n in (33, 37, 45, 50)
        },
        **{
            f"kvhive.methods.subgen_attention.xǁStreamingStructuresǁ__init____mutmut_{n}": (
                "killed by tests/methods/test_subgen.py::test_structures_store_vectors_in_the_model_dtype_and_start_empty "
                "(applied by hand)"
            )
            for n in (8, 11, 17, 22, 24, 30, 34, 50, 56, 82, 87, 93, 98, 118, 121)
        },
        **{
            f"kvhive.methods.subgen_attention.xǁStreamingStructuresǁ__init____mutmut_{n}": (
                "equivalent: float32 is torch's default dtype (kvhive never changes it)"
            )
            for n in (28, 32, 69, 73, 103, 107)
        },
        **{
            f"kvhive.methods.subgen_attention.xǁStreamingStructuresǁ__init____mutmut_{n}": (
                "equivalent on CPU: only the tensor's device changes"
            )
            for n in (12, 23, 33, 43, 57, 65, 74, 88, 99, 108, 115, 122)
        },
        "kvhive.methods.subgen_attention.xǁStreamingStructuresǁ__init____mutmut_77": 'equivalent: float("NAN") is float("nan")',
        **{
            f"kvhive.methods.pyramidkv.x_pyramid_budgets__mutmut_{n}": (
                "killed by tests/methods/test_pyramidkv.py (the 2 (b - w) boundary, sizes and context_length bounds; "
                "applied by hand)"
            )
            for n in (2, 3, 5, 6, 8, 9, 19, 20, 21, 26, 27, 29, 30, 31, 32, 34, 47)
        },
        "kvhive.methods.pyramidkv.x_pyramid_budgets__mutmut_59": (
            "equivalent: at equality the clamp sets the largest share to the value it already has"
        ),
        **{
            f"kvhive.methods.pyramidkv.x_pyramid_budgets__mutmut_{n}": (
                "message text only: the error is still raised naming budget and window"
            )
            for n in (87, 88, 90)
        },
        **{
            f"kvhive.methods.snapkv.x_observation_scores__mutmut_{n}": (
                "killed by tests/methods/test_baselines.py::test_snapkv_keeps_top_observation_scores_and_window "
                "(average pooling, kernel 5, hand-computed; applied by hand)"
            )
            for n in (46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57)
        },
        "kvhive.methods.snapkv.x_observation_scores__mutmut_17": "equivalent: pooling with kernel 1 is the identity",
        "kvhive.methods.snapkv.x_observation_scores__mutmut_18": "equivalent: the kernel is validated odd, so kernel 2 never occurs",
        "kvhive.methods.snapkv.x_observation_scores__mutmut_20": (
            "equivalent in selection: a one-token prefix is the only candidate whatever its pooled score"
        ),
        "kvhive.methods.snapkv.x_observation_scores__mutmut_27": (
            "equivalent: 1-D pooling of a 2-D input treats it as one unbatched channel, the same values"
        ),
        _SUBGEN + "x_maintain_candidates__mutmut_179": (
            "killed by tests/methods/test_subgen.py::test_decode_bookkeeping_matches_the_reference_per_head_with_several_joining "
            "(applied by hand)"
        ),
        _SUBGEN + "x_maintain_candidates__mutmut_180": "equivalent: two stored tokens never share a position",
        **{
            _SUBGEN + f"x_maintain_candidates__mutmut_{n}": (
                "killed by tests/methods/test_subgen.py::test_decode_bookkeeping_matches_the_reference_per_head_with_several_joining "
                "(applied by hand)"
            )
            for n in (142, 170)
        },
        **{
            _SUBGEN + f"x_maintain_candidates__mutmut_{n}": (
                "equivalent in results: every pair's distance is held by its newer member's entry (computed over all "
                "older candidates when it joined, recomputed when its partner leaves), so the minimum over entries is "
                "the closest pair whether or not older entries are tightened"
            )
            for n in (136, 139, 204, 207)
        },
        _SUBGEN + "x_maintain_candidates__mutmut_200": (
            "equivalent in results: recomputing more entries gives the same exact nearest distances (more work)"
        ),
        _SUBGEN + "x_maintain_candidates__mutmut_149": (
            "equivalent in the cache's use: every row of a layer enters with the same excess (same kept budget, "
            "same tokens joining), so no row is ever active at excess 0 while another has more"
        ),
        _SUBGEN + "x_maintain_candidates__mutmut_175": (
            "equivalent: a candidate's recorded nearest is always an alive candidate, so every row has a partner"
        ),
        **{
            _SUBGEN
            + f"x_maintain_candidates__mutmut_{n}": "equivalent: dim +1 of a 2-D [rows, tokens] tensor is dim -1"
            for n in (143, 172, 176)
        },
        **{
            _SUBGEN + f"x_maintain_candidates__mutmut_{n}": (
                "equivalent in results: the sentinel of an inactive row (or of a token without partner, which a "
                "row over its target never has) at most triggers an exact recompute"
            )
            for n in (38, 62, 63, 197, 198)
        },
    }
)


# Later reviews, one TOML file per area (results/mutation/reviews/*.toml: mutant name = verdict), so
# that reviews of different modules are written side by side without touching this file.
REVIEWS_DIR = Path(__file__).resolve().parent.parent / "results" / "mutation" / "reviews"
for _review_file in sorted(REVIEWS_DIR.glob("*.toml")):
    REVIEWED.update(tomllib.loads(_review_file.read_text()))


def reason(name: str, change: str) -> str:
    if name in REVIEWED:
        return REVIEWED[name]
    for pattern, why in REASONS:
        if pattern in change:
            return why
    function = name.split("ǁ")[-1] if "ǁ" in name else name.split(".")[-1]
    for pattern, why in FUNCTION_REASONS:
        if pattern in function:
            return why
    return "to review"


def changed_line(name: str) -> str:
    """The mutant's changed line(s) from ``mutmut show`` (the + side of its diff)."""
    shown = subprocess.run([sys.executable, "-m", "mutmut", "show", name], capture_output=True, text=True).stdout
    added = [line[1:].strip() for line in shown.splitlines() if line.startswith("+") and not line.startswith("+++")]
    return " / ".join(added)[:160] or "(see mutmut show)"


def to_review(module: str) -> None:
    """Print the survivors of one module (e.g. ``subgen_attention.py``) that have no verdict yet, with
    their change: the work list for a reviewer (``python scripts/mutation_summary.py --to-review X``)."""
    statuses = load(Path("mutants")).get(module, {})
    for name in sorted(n for n, status in statuses.items() if status == "survived"):
        change = changed_line(name)
        if reason(name, change) == "to review":
            print(f"{name}\t{change}")


def main() -> None:
    if sys.argv[1:2] == ["--to-review"]:
        to_review(sys.argv[2])
        return
    by_module = load(Path("mutants"))
    print("# Mutation testing of kvhive/methods/ (mutmut)\n")
    print("| module | mutants | " + " | ".join(COLUMNS) + " | kill rate of checked |")
    print("|---|---|" + "---|" * len(COLUMNS) + "---|")
    totals: collections.Counter[str] = collections.Counter()
    for module, statuses in by_module.items():
        counts = collections.Counter(statuses.values())
        totals.update(counts)
        checked = counts["killed"] + counts["survived"]
        rate = f"{counts['killed'] / checked:.0%}" if checked else "–"
        row = " | ".join(str(counts[c]) for c in COLUMNS)
        print(f"| {module} | {len(statuses)} | {row} | {rate} |")
    checked = totals["killed"] + totals["survived"]
    row = " | ".join(str(totals[c]) for c in COLUMNS)
    rate = f"{totals['killed'] / checked:.0%}" if checked else "–"
    print(f"| **all** | {sum(totals.values())} | {row} | {rate} |\n")
    print("## Surviving mutants\n")
    for module, statuses in by_module.items():
        survivors = sorted(name for name, status in statuses.items() if status == "survived")
        if not survivors:
            continue
        print(f"### {module} ({len(survivors)})\n")
        for name in survivors:
            change = changed_line(name)
            print(f"- `{name}`: `{change}` — {reason(name, change)}")
        print()


if __name__ == "__main__":
    main()
