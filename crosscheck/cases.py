"""The cases compared, shared by both sides (plain Python: imported in the kvpress venv and in
the kvhive venv alike, so it imports neither library).

Ratios: kvpress's ``compression_ratio`` is the fraction *removed*; kvhive's ``ratio`` is the
fraction *kept*. A case at kvpress compression ratio ``c`` runs kvhive at ``ratio = 1 - c``.

Each case names a kvpress press with its settings (kvpress's defaults unless said otherwise) and
the kvhive method with the parameters that reproduce them. ``variant`` cases run kvhive with a
setting that deliberately differs from kvpress (METHODS.md choices), to measure that choice.
``ablations`` name extra kvhive runs (at kvpress's kept counts) with one kvpress rule emulated
in the cross-check script (kvhive's files are not touched), to show that this one rule explains
the remaining difference:

* ``count_include_pad``: SnapKV/PyramidKV average pooling divides the edge windows by the full
  kernel (zero padding counted, torch's default, as kvpress and the SnapKV/PyramidKV reference
  code do) instead of kvhive's ``count_include_pad=False``.
* ``force_last_token``: TOVA always keeps the last prompt token (kvpress pads its score with
  ``max + 1``); kvhive, like the TOVA paper, lets it compete on its attention weight.
* ``safeguard_counts_window``: Ada-KV's safeguard. kvpress's ``AdaKVPress`` gives every head its
  own top ``int(alpha * n_kept)`` scores, counted over all its tokens, the observation window
  included (SnapKV scores the window ``max + 1``, so the window is the first of them); kvhive's
  ``allocation="kvpress"`` gives every head its window and then its own top ``floor(alpha * b')``
  of the ``b' = b - window`` selected tokens. The ablation runs kvhive with the alpha whose
  ``floor(alpha * b')`` is ``max(0, int(alpha * n_kept) - window)``: kvpress's safeguard beyond the
  window.

A press named with ``inner_press`` wraps a scorer press (``AdaKVPress(press=...)``): ``press_kwargs``
are the wrapper's, ``inner_press_kwargs`` the scorer's (``compression_ratio`` goes to the scorer).
"""

from __future__ import annotations

COMPRESSION_RATIOS = (0.5, 0.25)

CASES = [
    # kvpress SnapKVPress defaults: window_size=64, kernel_size=5, avg_pool1d (count_include_pad=True).
    dict(
        case="snapkv",
        press="SnapKVPress",
        press_kwargs=dict(window_size=64, kernel_size=5),
        method="snapkv",
        method_kwargs=dict(window=64, kernel=5, pooling="avg"),
        ablations=["count_include_pad"],
    ),
    # Same kvpress press; kvhive with its METHODS.md choice of max pooling (the Ada-KV paper).
    dict(
        case="snapkv/max-pool",
        press="SnapKVPress",
        press_kwargs=dict(window_size=64, kernel_size=5),
        method="snapkv",
        method_kwargs=dict(window=64, kernel=5, pooling="max"),
        variant=True,
    ),
    # kvhive's default window/kernel (32/7) run on both sides, avg pooling on both.
    dict(
        case="snapkv/w32-k7",
        press="SnapKVPress",
        press_kwargs=dict(window_size=32, kernel_size=7),
        method="snapkv",
        method_kwargs=dict(window=32, kernel=7, pooling="avg"),
        ablations=["count_include_pad"],
    ),
    # kvpress StreamingLLMPress default n_sink=4 (= kvhive's sink=4).
    dict(
        case="streamingllm",
        press="StreamingLLMPress",
        press_kwargs=dict(n_sink=4),
        method="streamingllm",
        method_kwargs=dict(sink=4),
    ),
    # kvpress TOVAPress: last query's attention, averaged over all query heads, last token forced.
    dict(
        case="tova",
        press="TOVAPress",
        press_kwargs=dict(),
        method="tova",
        method_kwargs=dict(),
        ablations=["force_last_token"],
    ),
    # kvpress KnormPress: score = -||k||, keep the smallest key norms.
    dict(case="knorm", press="KnormPress", press_kwargs=dict(), method="knorm", method_kwargs=dict()),
    # kvpress AdaKVPress(SnapKVPress) defaults: alpha_safeguard=0.20, head-wise budgets over the KV heads (the
    # SnapKV scores pooled per query head, then averaged over the group); kvhive's Ada-SnapKV with kvpress's
    # allocation rule, per KV head, the same pooling order.
    dict(
        case="ada-snapkv",
        press="AdaKVPress",
        press_kwargs=dict(alpha_safeguard=0.2),
        inner_press="SnapKVPress",
        inner_press_kwargs=dict(window_size=64, kernel_size=5),
        method="ada-snapkv",
        method_kwargs=dict(
            window=64,
            kernel=5,
            pooling="avg",
            group_pooling="pool_then_mean",
            allocation="kvpress",
            alpha=0.2,
            head_granularity="kv",
        ),
        ablations=["safeguard_counts_window"],
    ),
    # kvpress PyramidKVPress defaults: window_size=64, kernel_size=5, beta=20 (SnapKV scoring).
    dict(
        case="pyramidkv",
        press="PyramidKVPress",
        press_kwargs=dict(window_size=64, kernel_size=5, beta=20),
        method="pyramidkv",
        method_kwargs=dict(window=64, kernel=5, pooling="avg", beta=20),
        ablations=["count_include_pad"],
    ),
]


def case_key(case: str, compression_ratio: float) -> str:
    return f"{case}@{compression_ratio:g}"
