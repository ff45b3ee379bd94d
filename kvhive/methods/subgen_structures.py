"""The two data structures of SubGen's streaming attention (Zandieh et al., 2024, Algorithm 1),
for many independent streams at once: ``D``, the clusters of radius ``delta`` with their reservoir
samples (UPDATESOFTMAXNORMALIZER), and ``M``, the ℓ2 samples of keys and values
(UPDATEMATRIXPRODUCT). :class:`StreamingStructures` inserts tokens in stream order and answers a
query with the estimator's numerator and denominator; the policy that owns them is
:class:`kvhive.methods.subgen_attention.SubGenAttention`.
"""

from __future__ import annotations

import copy

import torch

from kvhive.methods.counter_random import fold, hashed_words, second_word, uniforms_of

# What a counter-based draw is for (one hash input), so the two kinds of draw never coincide.
_VALUE_SAMPLES, _CLUSTER_SAMPLES = 1, 2

# Tokens whose cluster assignment is resolved together (distances to the existing
# representatives in one matrix product; the founding of new clusters loops inside a chunk).
_ASSIGN_CHUNK = 128

_SAME_SIZE_INTEGER = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _blend_(target: torch.Tensor, replace: torch.Tensor, source: torch.Tensor) -> None:
    """``target.copy_(torch.where(replace, source, target))`` (``replace`` and ``source`` broadcast
    to ``target``), bit for bit, as integer operations in place: ``t ^= (t ^ s) & -replace`` on
    the values' bits. On CPU ``where`` over a ``[R, s, d]`` block is several times slower than an
    elementwise integer op, and this writes the block once instead of twice."""
    integer = _SAME_SIZE_INTEGER[target.element_size()]
    bits = target.view(integer)
    select = -replace.to(integer)  # all ones where replaced
    bits.bitwise_xor_(bits.bitwise_xor(source.to(target.dtype).view(integer)).bitwise_and_(select))


class StreamingStructures:
    """``D`` and ``M`` of Algorithm 1 for ``rows`` independent streams (one per batch × KV head).

    Tensors (``R`` rows, capacity ``C`` clusters):
    ``representatives [R, C, d]``, ``counts [R, C]`` (0 = unused slot), ``samples [R, C, t, d]``,
    ``num_clusters [R]``, ``radius [R]`` (NaN until the row's first insertion),
    ``m_keys / m_values [R, s, d]``, ``m_sqnorm [R, s]`` (0 = empty slot), ``mu [R]`` (float64).
    """

    def __init__(
        self,
        rows: int,
        dim: int,
        t: int,
        s: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        seed: int,
        delta: float,
        relative_delta: bool,
        max_clusters: int | None = None,
        streams_per_seed: int | None = None,
    ) -> None:
        self.rows, self.dim, self.t, self.s = rows, dim, t, s
        self.delta, self.relative_delta = float(delta), relative_delta
        # Draws are a hash of (seed, the row's stream, the row's tokens inserted so far, ...):
        # row r draws as stream r % streams_per_seed (the policy: one stream per KV head, so a
        # batch row draws what it draws alone); None: every row its own stream.
        self.seed = seed
        stream = torch.arange(rows, device=device) % (streams_per_seed or max(rows, 1))
        # The hash of (seed, stream, purpose) per row, once: a draw then folds in two inputs.
        self._set_purpose_words(
            {purpose: hashed_words(seed, stream, purpose) for purpose in (_VALUE_SAMPLES, _CLUSTER_SAMPLES)}
        )
        # None: unbounded (capacity doubles as clusters are founded); else allocated once.
        self.max_clusters = max_clusters
        self.beyond_radius = torch.zeros(rows, dtype=torch.long, device=device)
        self.representatives = torch.zeros(rows, 0, dim, dtype=dtype, device=device)
        self.representative_sq = torch.zeros(rows, 0, dtype=torch.float32, device=device)
        self.counts = torch.zeros(rows, 0, dtype=torch.long, device=device)
        self.samples = torch.zeros(rows, 0, t, dim, dtype=dtype, device=device)
        self.num_clusters = torch.zeros(rows, dtype=torch.long, device=device)
        self.radius = torch.full((rows,), float("nan"), dtype=torch.float32, device=device)
        self.m_keys = torch.zeros(rows, s, dim, dtype=dtype, device=device)
        self.m_values = torch.zeros(rows, s, dim, dtype=dtype, device=device)
        self.m_sqnorm = torch.zeros(rows, s, dtype=torch.float32, device=device)
        self.mu = torch.zeros(rows, dtype=torch.float64, device=device)
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        if max_clusters is not None:
            self._grow(max_clusters)

    # -- accounting ------------------------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            "representatives": self.representatives,
            "representative_sq": self.representative_sq,
            "counts": self.counts,
            "samples": self.samples,
            "num_clusters": self.num_clusters,
            "radius": self.radius,
            "m_keys": self.m_keys,
            "m_values": self.m_values,
            "m_sqnorm": self.m_sqnorm,
            "mu": self.mu,
            "tokens": self.tokens,
            "beyond_radius": self.beyond_radius,
        }

    def nbytes(self) -> int:
        """Bytes allocated by the structures (capacity included)."""
        return sum(x.numel() * x.element_size() for x in self.tensors().values())

    def used_nbytes(self) -> int:
        """Bytes of the entries in use: each row's clusters (representative, ``t`` samples,
        count) plus ``M`` and the per-row scalars; what a ragged layout would hold."""
        element = self.samples.element_size()
        clusters = int(self.num_clusters.sum())
        per_cluster = (
            (self.t + 1) * self.dim * element + self.counts.element_size() + self.representative_sq.element_size()
        )
        fixed = sum(
            x.numel() * x.element_size()
            for name, x in self.tensors().items()
            if name not in ("representatives", "representative_sq", "counts", "samples")
        )
        return clusters * per_cluster + fixed

    @property
    def capacity(self) -> int:
        return self.counts.shape[1]

    # -- batch rows ------------------------------------------------------------------------------
    def select_rows(self, rows: torch.Tensor) -> StreamingStructures:
        """The structures of rows ``rows`` (``[R']`` indices; may repeat or reorder), a new object.
        Every row keeps its stream and its own draws (they depend on the row's stream and tokens
        only), so a selected row goes on exactly as before."""
        selected = copy.copy(self)
        rows = rows.to(self.counts.device)
        selected.rows = int(rows.numel())
        for name, tensor in self.tensors().items():
            setattr(selected, name, tensor.index_select(0, rows))
        selected._set_purpose_words(
            {purpose: words.index_select(0, rows) for purpose, words in self._purpose_words.items()}
        )
        return selected

    def _set_purpose_words(self, words: dict) -> None:
        """Each row's hash of (seed, stream, purpose), and both purposes as ``[R, 2]`` (value
        samples, cluster samples: a one-token insertion hashes both at once). Set together, so
        selected or concatenated rows keep them in step."""
        self._purpose_words = words
        self._purpose_pair = torch.stack([words[_VALUE_SAMPLES], words[_CLUSTER_SAMPLES]], 1)

    def empty_like(self, rows: int, streams_per_seed: int) -> StreamingStructures:
        """Structures of ``rows`` rows that inserted nothing yet, with these ones' parameters (what a
        layer creates at its first insertion)."""
        return StreamingStructures(
            rows,
            self.dim,
            self.t,
            self.s,
            dtype=self.samples.dtype,
            device=self.counts.device,
            seed=self.seed,
            delta=self.delta,
            relative_delta=self.relative_delta,
            max_clusters=self.max_clusters,
            streams_per_seed=streams_per_seed,
        )

    @classmethod
    def concatenate(cls, parts: list[StreamingStructures]) -> StreamingStructures:
        """The rows of ``parts`` (same parameters) stacked in order, a new object (the parts are left
        as they were); unbounded parts are grown to the largest capacity first."""
        capacity = max(part.capacity for part in parts)
        grown = []
        for part in parts:
            part = copy.copy(part)  # _grow rebinds the tensors: the original keeps its own
            part._grow(capacity)
            grown.append(part)
        stacked = copy.copy(grown[0])
        stacked.rows = sum(part.rows for part in grown)
        for name in grown[0].tensors():
            setattr(stacked, name, torch.cat([getattr(part, name) for part in grown], dim=0))
        stacked._set_purpose_words(
            {
                purpose: torch.cat([part._purpose_words[purpose] for part in grown], dim=0)
                for purpose in grown[0]._purpose_words
            }
        )
        return stacked

    def _grow(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        new_capacity = max(needed, 2 * self.capacity, 4)
        if self.max_clusters is not None:
            new_capacity = self.max_clusters
        extra = new_capacity - self.capacity
        self.representatives = torch.cat(
            [self.representatives, self.representatives.new_zeros(self.rows, extra, self.dim)], dim=1
        )
        self.representative_sq = torch.cat(
            [self.representative_sq, self.representative_sq.new_zeros(self.rows, extra)], dim=1
        )
        self.counts = torch.cat([self.counts, self.counts.new_zeros(self.rows, extra)], dim=1)
        self.samples = torch.cat([self.samples, self.samples.new_zeros(self.rows, extra, self.t, self.dim)], dim=1)

    def _draws(self, purpose: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two ``float64`` uniform tensors on ``[0, 1)`` (a grid of ``2**-24``, as torch.rand's
        float32) of shape ``[R, *index.shape[1:]]`` (``index``: ``[1, ...]`` integers), computed
        on the device from (seed, the row's stream, ``purpose``, the row's tokens inserted before
        this insertion, ``index``): no generator state, no host read, and a row's draws depend on
        nothing else in the batch. One hash gives both (few kernels per insertion)."""
        row = self._purpose_words[purpose].view((self.rows,) + (1,) * (index.dim() - 1))
        tokens = self.tokens.view(row.shape)
        word = fold(fold(row, tokens), index)
        return uniforms_of(word, torch.float64), uniforms_of(second_word(word), torch.float64)

    # -- insertion -------------------------------------------------------------------------------
    def insert(self, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Insert the tokens ``keys/values [R, n, d]`` where ``mask [R, n]``, in stream order.

        Returns the cluster index of each token ``[R, n]`` (-1 where not inserted).
        """
        keys = keys.to(self.samples.dtype)
        values = values.to(self.m_values.dtype)
        # No early exit on an empty mask (that would be a host read): every step below leaves a
        # row that inserts nothing unchanged.
        if keys.shape[1] == 1 and self.max_clusters is not None:
            return self._insert_one(keys, values, mask)
        return self._insert_batch(keys, values, mask)

    def _insert_batch(self, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """:meth:`insert` of any number of tokens per row (the general path; ``_insert_one`` is its
        one-token form and must give the same structures)."""
        self._set_radius(keys, mask)
        self._update_matrix_product(keys, values, mask)
        assignment = self._assign(keys, mask)
        self._update_cluster_samples(keys, assignment)
        self.tokens += mask.sum(-1)
        return assignment

    def _insert_one(self, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """:meth:`insert` of one token per row (a decode step) into bounded structures: the same
        draws and the same updates, without the batch machinery. Only the joined cluster's ``t``
        reservoir slots can change (the other clusters got nothing: their coins never replace),
        so only its coins are hashed and only its samples rewritten; with one token the draws
        of which added token replaces a slot always pick it (``M``'s inverse CDF and the
        reservoir's rank), so those uniforms are not computed; and the coins of ``M`` and of the
        cluster are hashed together (one fold of ``[R, s + t]`` indices)."""
        rows, _, dim = keys.shape
        s, t = self.s, self.t
        if self.relative_delta:
            # _set_radius of one token: its norm is the mean (a row inserting nothing sets nothing).
            norm = keys[:, 0].float().norm(dim=-1)
            value = self.delta * torch.where(norm > 0, norm, 1.0)
            self.radius.copy_(torch.where(torch.isnan(self.radius) & mask[:, 0], value, self.radius))
        else:
            self._set_radius(keys, mask)
        assignment = self._assign_one(keys, mask)
        inserted = assignment >= 0
        cluster = assignment.clamp_min(0)  # [R, 1]
        # The words _draws hashes: fold(fold(purpose word, tokens inserted so far), index), with
        # index the slot of M and cluster * t + slot for the reservoir.
        words = fold(self._purpose_pair, self.tokens[:, None])
        device = keys.device
        index = torch.cat(
            [torch.arange(s, device=device).expand(rows, s), cluster * t + torch.arange(t, device=device)], dim=1
        )
        coins = uniforms_of(
            fold(torch.cat([words[:, :1].expand(rows, s), words[:, 1:].expand(rows, t)], dim=1), index), torch.float64
        )
        # UPDATEMATRIXPRODUCT: each slot replaced by the token with probability ‖v‖² / (μ + ‖v‖²).
        weight = (values.double() ** 2).sum(-1) * mask  # [R, 1]
        added = weight[:, 0]
        probability = torch.where(added > 0, added / (self.mu + added), torch.zeros_like(added))
        replace = coins[:, :s] < probability[:, None]
        self.mu.add_(added)
        _blend_(self.m_keys, replace[..., None], keys)
        _blend_(self.m_values, replace[..., None], values)
        self.m_sqnorm.copy_(torch.where(replace, (values.float() ** 2).sum(-1), self.m_sqnorm))
        # UPDATESOFTMAXNORMALIZER's reservoir: slot j of the joined cluster replaced with
        # probability 1 / (count + 1).
        old = self.counts.gather(1, cluster)
        replace = (coins[:, s:] * (old + 1) < 1) & inserted
        self.counts.scatter_add_(1, cluster, inserted.long())
        slots = cluster[:, :, None, None].expand(rows, 1, t, dim)
        current = self.samples.gather(1, slots)
        self.samples.scatter_(1, slots, torch.where(replace[:, None, :, None], keys[:, :, None, :], current))
        self.tokens += mask.sum(-1)
        return assignment

    def _assign_one(self, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """:meth:`_assign` of one token per row into bounded structures (one founding round, the
        same arithmetic): ``[R, 1]`` cluster indices, -1 where not inserted."""
        rows = keys.shape[0]
        device = keys.device
        threshold = (self.radius.float() ** 2)[:, None]
        work = keys.float()  # [R, 1, d]
        dots = torch.matmul(work, self.representatives.float().transpose(-1, -2))
        distances = ((work * work).sum(-1)[..., None] - 2 * dots + self.representative_sq[:, None, :]).clamp_min_(0)
        unused = torch.arange(self.capacity, device=device) >= self.num_clusters[:, None]
        best, best_index = distances.masked_fill(unused[:, None, :], float("inf")).min(-1)  # [R, 1]
        # A key farther than the radius from every representative founds a cluster where there is
        # room (its distance to its own representative is exactly 0).
        founding = mask & (best > threshold) & self._room()[:, None]
        slot = self.num_clusters.clamp_max(self.capacity - 1)
        row_index = torch.arange(rows, device=device)
        representative = torch.where(
            founding, work[:, 0].to(self.representatives.dtype), self.representatives[row_index, slot]
        )
        self.representatives[row_index, slot] = representative
        self.representative_sq[row_index, slot] = torch.where(
            founding[:, 0], (representative.float() ** 2).sum(-1), self.representative_sq[row_index, slot]
        )
        self.num_clusters.add_(founding[:, 0].long())
        closer = founding & (best > 0)
        best = torch.where(closer, 0.0, best)
        # A row at max_clusters: a key beyond the radius joins its nearest cluster anyway and is
        # counted (the stream is not clusterable at this radius and budget).
        self.beyond_radius += (mask & (best > threshold)).sum(-1)
        return torch.where(mask, torch.where(closer, slot[:, None], best_index), -1)

    def _set_radius(self, keys: torch.Tensor, mask: torch.Tensor) -> None:
        unset = torch.isnan(self.radius) & mask.any(-1)
        if self.relative_delta:
            norms = keys.float().norm(dim=-1)
            mean_norm = (norms * mask).sum(-1) / mask.sum(-1).clamp_min(1)
            # A row of all-zero keys still needs a positive radius.
            scale = torch.where(mean_norm > 0, mean_norm, torch.ones_like(mean_norm))
            value = self.delta * scale
        else:
            value = torch.full_like(self.radius, self.delta)
        self.radius.copy_(torch.where(unset, value, self.radius))  # in place: buffers keep their address

    def _update_matrix_product(self, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> None:
        """UPDATEMATRIXPRODUCT for a batch: the net effect of the token-by-token coin flips."""
        weights = (values.double() ** 2).sum(-1) * mask  # ‖v‖², 0 for tokens not inserted
        added = weights.sum(-1)
        probability = torch.where(added > 0, added / (self.mu + added), torch.zeros_like(added))
        # Per row: s coin flips, then s draws ∝ ‖v‖² by inverse CDF (padding, weight 0, is never
        # drawn and does not shift the draws: a row draws what it draws alone).
        slots = torch.arange(self.s, device=keys.device)[None, :]
        coin, draw = self._draws(_VALUE_SAMPLES, slots)
        replace = coin < probability[:, None]
        target = draw * added[:, None]
        self.mu.add_(added)
        cumulative = weights.cumsum(-1)
        drawn = torch.searchsorted(cumulative, target, right=True).clamp_max_(weights.shape[-1] - 1)
        # Every slot is written (a fixed amount of work): a slot not replaced keeps its entry.
        index = drawn[..., None].expand(-1, -1, keys.shape[-1])
        # In place: the structures' buffers keep their addresses (a captured decode step reads them).
        self.m_keys.copy_(torch.where(replace[..., None], keys.gather(1, index), self.m_keys))
        self.m_values.copy_(torch.where(replace[..., None], values.gather(1, index), self.m_values))
        drawn_sqnorm = (values.gather(1, index).float() ** 2).sum(-1)
        self.m_sqnorm.copy_(torch.where(replace, drawn_sqnorm, self.m_sqnorm))

    def _assign(self, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """UPDATESOFTMAXNORMALIZER's clustering for a batch, in stream order (founds clusters)."""
        rows, length, _ = keys.shape
        device = keys.device
        assignment = torch.full((rows, length), -1, dtype=torch.long, device=device)
        threshold = (self.radius.float() ** 2)[:, None]
        row_index = torch.arange(rows, device=device)
        work = keys.float()
        for start in range(0, length, _ASSIGN_CHUNK):
            chunk = work[:, start : start + _ASSIGN_CHUNK]
            present = mask[:, start : start + _ASSIGN_CHUNK]
            width = chunk.shape[1]
            # Bounded structures compare against every slot (unused ones masked): a fixed shape.
            # Unbounded ones (tests, statistics) grow, so they read how many slots are in use.
            used = self.capacity if self.max_clusters is not None else int(self.num_clusters.max())
            if used > 0:
                reps = self.representatives[:, :used].float()
                dots = torch.matmul(chunk, reps.transpose(-1, -2))
                distances = (
                    (chunk * chunk).sum(-1)[..., None] - 2 * dots + self.representative_sq[:, None, :used]
                ).clamp_min_(0)
                unused = torch.arange(used, device=device)[None, :] >= self.num_clusters[:, None]
                distances = distances.masked_fill(unused[:, None, :], float("inf"))
                best, best_index = distances.min(-1)
            else:
                best = torch.full((rows, width), float("inf"), device=device)
                best_index = torch.full((rows, width), -1, dtype=torch.long, device=device)
            columns = torch.arange(width, device=device)[None, :]
            room = self._room()
            uncovered = present & (best > threshold) & room[:, None]
            # Each round founds at most one cluster per row (its first uncovered key), so a row
            # founds at most min(width, max_clusters) in a chunk: that many masked rounds.
            rounds = width if self.max_clusters is None else min(width, self.max_clusters)
            for _ in range(rounds):
                founding = uncovered.any(-1)
                first = uncovered.to(torch.int8).argmax(-1)
                if self.max_clusters is None:
                    self._grow(int(self.num_clusters.max()) + 1)
                slot = self.num_clusters.clamp_max(self.capacity - 1)
                founder = chunk[row_index, first].to(self.representatives.dtype)
                # A row that founds nothing writes its slot's current entry back.
                representative = torch.where(founding[:, None], founder, self.representatives[row_index, slot])
                self.representatives[row_index, slot] = representative
                self.representative_sq[row_index, slot] = torch.where(
                    founding, (representative.float() ** 2).sum(-1), self.representative_sq[row_index, slot]
                )
                self.num_clusters.add_(founding.long())
                # Direct differences: the founder's own distance is exactly 0.
                to_founder = ((chunk - founder[:, None, :]) ** 2).sum(-1)
                later = founding[:, None] & (columns >= first[:, None])
                closer = later & (to_founder < best)
                best = torch.where(closer, to_founder, best)
                best_index = torch.where(closer, slot[:, None], best_index)
                room = self._room()
                uncovered = present & (best > threshold) & room[:, None]
            # A row at max_clusters: a key beyond the radius joins its nearest cluster anyway and
            # is counted (the stream is not clusterable at this radius and budget).
            self.beyond_radius += (present & (best > threshold)).sum(-1)
            assignment[:, start : start + width] = torch.where(present, best_index, -1)
        return assignment

    def _room(self) -> torch.Tensor:
        """``[R]`` whether a row may still found a cluster."""
        if self.max_clusters is None:
            return torch.ones_like(self.num_clusters, dtype=torch.bool)
        return self.num_clusters < self.max_clusters

    def token_equivalents(self) -> torch.Tensor:
        """``[R]`` tokens' worth (one token = a key and a value) of the entries in use per row:
        ``s`` samples of M plus ``(t + 1) / 2`` per cluster."""
        return self.s + self.num_clusters.float() * (self.t + 1) / 2

    def _update_cluster_samples(self, keys: torch.Tensor, assignment: torch.Tensor) -> None:
        """Reservoir update of every cluster's ``t`` samples and its count for a batch.

        Fixed shapes ``[R, C, t]``: every (cluster, slot) draws a coin (replaced with probability
        ``added / (old + added)``, never for a cluster that got nothing) and a rank among the
        cluster's added keys (uniform); the replaced slots take that key."""
        rows, length, dim = keys.shape
        capacity = self.capacity
        if capacity == 0:
            return
        device = keys.device
        inserted = assignment >= 0
        flat_cluster = torch.where(
            inserted, torch.arange(rows, device=device)[:, None] * capacity + assignment, rows * capacity
        ).reshape(-1)
        # Keys added per cluster (scatter_add over a fixed size: bincount's size would be a read).
        added = torch.zeros(rows * capacity + 1, dtype=torch.long, device=device)
        added.scatter_add_(0, flat_cluster, torch.ones_like(flat_cluster))
        added = added[:-1].view(rows, capacity)
        # Members of each cluster, grouped: stable sort of the tokens by cluster id (stream order).
        order = torch.sort(flat_cluster, stable=True).indices
        starts = (torch.cumsum(added.reshape(-1), 0) - added.reshape(-1)).view(rows, capacity)
        cluster_slots = torch.arange(capacity * self.t, device=device).view(1, capacity, self.t)
        old, new = self.counts[..., None], added[..., None]
        coin, draw = self._draws(_CLUSTER_SAMPLES, cluster_slots)
        replace = coin * (old + new) < new
        rank = (draw * new).long().clamp_max_((new - 1).clamp_min(0))
        self.counts += added
        member = order[(starts[..., None] + rank).clamp_max_(order.numel() - 1)]  # flat token index
        drawn = keys.reshape(rows * length, dim)[member.reshape(-1)].view(rows, capacity, self.t, dim)
        self.samples.copy_(torch.where(replace[..., None], drawn, self.samples))

    # -- query -----------------------------------------------------------------------------------
    def query(self, queries: torch.Tensor, scaling: float):
        """QUERYSTREAMATTN relative to a max logit for ``queries [R, Q, d]``.

        Returns ``(z [R, Q, d], tau [R, Q], max_logit [R, Q])`` with
        ``z = Σ_M μ/(s‖v‖²) e^{l − max} v`` and ``tau = Σ_D n'/t Σ_S e^{l − max}``.
        """
        rows, num_queries, dim = queries.shape
        work = queries.float()
        # Every slot (unused ones weigh 0 and are masked): a fixed shape, no read of the clusters in use.
        used = self.capacity
        samples = self.samples.reshape(rows, used * self.t, dim).float()
        cluster_weight = (
            (self.counts.float() / self.t)[..., None].expand(rows, used, self.t).reshape(rows, used * self.t)
        )
        sample_logits = torch.matmul(work, samples.transpose(-1, -2)) * scaling
        sample_logits = sample_logits.masked_fill((cluster_weight == 0)[:, None, :], float("-inf"))
        filled = self.m_sqnorm > 0
        product_logits = torch.matmul(work, self.m_keys.float().transpose(-1, -2)) * scaling
        product_logits = product_logits.masked_fill(~filled[:, None, :], float("-inf"))
        max_logit = product_logits.amax(-1)
        if used:
            max_logit = torch.maximum(max_logit, sample_logits.amax(-1))
        # Rounded to the queries' dtype first, so the returned max and the exponentials agree.
        max_logit = max_logit.clamp_min(torch.finfo(queries.dtype).min)
        if queries.dtype != torch.float16:  # fp16 would round a large max to inf (NaN once merged)
            max_logit = max_logit.to(queries.dtype).float()
        tau = (torch.exp(sample_logits - max_logit[..., None]) * cluster_weight[:, None, :]).sum(-1)
        product_weight = torch.where(
            filled,
            self.mu.float()[:, None] / (self.s * self.m_sqnorm.clamp_min(1e-30)),
            torch.zeros_like(self.m_sqnorm),
        )
        scaled = torch.exp(product_logits - max_logit[..., None]) * product_weight[:, None, :]
        z = torch.matmul(scaled, self.m_values.float())
        return z, tau, max_logit
