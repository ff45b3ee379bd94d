"""BumbleBee's streaming summary (Algorithm 2) with its similarity matrix cached.

Each decode step offers the newest token to a summary of ``T`` members per row; the summary keeps
the member set that maximises the streaming objective, updating one row and one column of its
cached similarity matrix per step instead of rebuilding it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvhive.methods.submodular_objective import Concave, key_norms, relu_cosine_similarity, safe_divide

# ---------------------------------------------------------------------------------------------
# Streaming summary (Algorithm 2) with the similarity matrix cached
# ---------------------------------------------------------------------------------------------


@dataclass
class StreamingSummary:
    """The summary ``S`` of ``R`` rows, ``T`` members each, with its similarity matrix cached.

    Members live in *slots* (fixed rows/columns of ``sim``): a new member takes the slot of the
    one it replaces, so a step writes one row and one column (``O(T)``) instead of rebuilding
    the matrix. ``slot_of_rank[r, i]`` is the slot of the ``i``-th oldest member, i.e. of the
    ``i``-th stored token (the cache stores tokens oldest first and the summary precedes the
    local window); ``rank_of_slot`` is its inverse. ``positions[r, i]`` is the ``i``-th member's
    original position, which lets the caller check that the cached matrix still matches what
    the cache stores.

    Because every member covers itself (``sim(v, v) = 1``) and the ground set of the
    streaming objective is ``S' = S + {x}`` (Alg. 2 instantiates ``f_FL`` and ``c`` on the
    summary), ``f_FL(S') - f_FL(S' - x) = sim(x, x) - max_{u in S' - x} sim(x, u)``: a step
    only needs each member's nearest other member (``nearest``), kept up to date in ``O(T)``
    per step plus a scan of the rows whose nearest member may have left.

    ``sim`` holds zeros on its diagonal (``self_sim`` holds ``sim(v, v)``): a row's maximum is
    then its nearest other member, with no masked copy of the matrix at each step.
    """

    sim: torch.Tensor  # [R, T, T] float32, by slot; zero diagonal
    self_sim: torch.Tensor  # [R, T] sim(v, v): 1, or 0 for padding / zero keys
    nearest: torch.Tensor  # [R, T] max_{u in S, u != v} sim(v, u)
    norms: torch.Tensor  # [R, T] key norms by slot
    valid: torch.Tensor  # [R, T] bool by slot
    slot_of_rank: torch.Tensor  # [R, T] long
    rank_of_slot: torch.Tensor  # [R, T] long
    positions: torch.Tensor  # [R, T] original positions by rank

    @property
    def size(self) -> int:
        return self.sim.shape[-1]

    @classmethod
    def from_similarity(
        cls, sim: torch.Tensor, norms: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor
    ) -> StreamingSummary:
        """Summary whose members (in stored order) have the similarity matrix ``sim[R, T, T]``."""
        rows, size, _ = sim.shape
        self_sim = sim.diagonal(dim1=1, dim2=2).clone()
        others = sim.contiguous().clone()
        others.diagonal(dim1=1, dim2=2).zero_()
        order = torch.arange(size, device=sim.device).expand(rows, size)
        return cls(
            others,
            self_sim,
            others.amax(dim=-1),
            norms.float().clone(),
            valid.clone(),
            order.clone(),
            order.clone(),
            positions.clone(),
        )

    @classmethod
    def from_keys(cls, keys: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor) -> StreamingSummary:
        """Summary of ``keys[R, T, d]`` (the first ``T`` stored tokens); ``O(T^2 d)``."""
        return cls.from_similarity(relu_cosine_similarity(keys, valid), key_norms(keys), valid, positions)

    def step(
        self,
        keys: torch.Tensor,
        valid: torch.Tensor,
        weights: torch.Tensor,
        positions: torch.Tensor,
        first_joiner: int,
        joiners: int,
        lam: float,
        phi: Concave,
        normalise_mass: bool = False,
        active: torch.Tensor | None = None,
        stored_of_rank: torch.Tensor | None = None,
        joiner: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Let ``joiners`` stored tokens ``first_joiner, first_joiner + 1, ...`` join one at a time;
        after each, drop the element of ``S' = S + {x}`` with the smallest marginal gain
        ``g(x | S' - x)`` (Alg. 2, lines 10-11). Returns the dropped stored indices ``[R, joiners]``.

        ``keys[R, N, d]``, ``valid[R, N]``, ``weights[R, N]`` (accumulated attention) and
        ``positions[R, N]`` describe the stored tokens; the members are stored first (stored
        index = rank), the joiners next. ``normalise_mass``: ``phi`` is applied to the weights
        divided by their sum over ``S'`` (BumbleBee's ``importance_scale="normalised"``). Invalid elements are dropped first. Cost per joiner:
        ``O(T d + T)`` plus a scan of the rows whose nearest member left.

        ``active`` (a device bool broadcast over the rows, for a step of fixed shape): where False,
        nothing joins (the state is left as it is; the dropped index returned there is meaningless).
        The state's tensors are updated in place (a compiled step keeps their addresses).

        ``stored_of_rank [R, >= first_joiner + joiners]``: for a cache that does not store the tokens
        in their order (it writes the newest token into a freed slot), the stored index of the token
        of each rank, ranked by position; the indices above are then ranks, and the dropped ones
        returned are stored indices.

        ``joiner`` (one joiner): ``(stored index [R, 1], key [R, 1, d], products [R, N])``, its key's
        products with every stored key computed elsewhere (the attention's, which read the keys
        anyway): its similarities are formed from them instead of a multiply-sum over the stored
        keys (the same dot products, summed in the matrix product's order).
        """
        if joiner is not None and joiners != 1:
            raise ValueError(f"invalid joiners={joiners!r} with a joiner's products given: expected 1")
        rows, size = self.slot_of_rank.shape
        slots = torch.arange(size, device=keys.device)
        by_rank = stored_of_rank is not None
        if by_rank:
            member_index = stored_of_rank.gather(1, self.rank_of_slot)  # stored index of each slot's member
        else:
            member_index = self.rank_of_slot.clone()
        # A decode step is a few hundred small ops, each costing more than its arithmetic:
        # the per-row values below stay [R, 1] (no unsqueeze per use), fresh temporaries are updated
        # in place, phi = log(1 + x) is applied inline (Concave's own formulas, without its dtype
        # casts of tensors that are float64 already), gathers broadcast their index
        # (take_along_dim: no expand), the weights of S' come from one gather at the members' and
        # x's stored indices, and the float64 row sum casts as it sums. Every value is computed as
        # before, to the bit (replayed streams against the previous step: the dropped indices and
        # every state tensor).
        log_form = phi.kind == "log"
        # phi(a(S')) of the log form is 0 or at least 2**-149 (a float64 sum of float32 weights,
        # each a multiple of 2**-149; normalised, 0 or 1): dividing by it unclamped is dividing by
        # its clamp at 1e-300, and where it is 0 the masked_fill below sets the term as before.
        unclamped_phi = log_form and (normalise_mass or weights.dtype != torch.float64)
        dropped = []
        for j in range(joiners):
            x = first_joiner + j
            if joiner is not None or by_rank:
                if joiner is not None:  # its stored index and key, chosen before the attention
                    x, key_x, _ = joiner
                else:
                    x = stored_of_rank[:, x : x + 1]  # [R, 1]
                    key_x = keys.take_along_dim(x[:, :, None], dim=1)
                valid_x = valid.gather(1, x)
                stored = keys  # the members are anywhere
                ground = torch.cat([member_index, x], dim=1)  # stored indices of S' (members by slot, x last)
            else:
                key_x, valid_x = keys[:, x : x + 1], valid[:, x : x + 1]
                stored = keys[:, :x]  # the members: the stored tokens before x
                ground = torch.nn.functional.pad(member_index, (0, 1), value=x)
            if key_x.dtype != torch.float32:
                key_x = key_x.float()  # [R, 1, d]
            if stored.dtype == torch.float64:  # a float32 product, as for every other key dtype
                stored = stored.float()
            raw_norm = torch.linalg.vector_norm(key_x, dim=-1)  # [R, 1] (Tensor.norm's kernel, without its wrapper)
            norm_x = raw_norm.clamp_min(1e-12)
            # O(T d): a multiply-sum beats a batched matrix-vector product on CPU here (the product
            # is formed in float32 for any key dtype: a 16-bit key's promotion casts it exactly, as
            # .float() does, without a float32 copy of the stored keys). vecdot is that multiply-sum.
            if joiner is not None:
                dots = joiner[2].gather(1, member_index)
            elif stored.dtype == torch.float32:
                dots = torch.linalg.vecdot(stored, key_x).gather(1, member_index)
            else:
                dots = (stored * key_x).sum(dim=-1).gather(1, member_index)
            sim_x = (dots / (self.norms * norm_x)).clamp_(min=0).mul_(self.valid & valid_x)
            self_x = (raw_norm / norm_x).square_().mul_(valid_x)

            nearest_with_x = torch.maximum(self.nearest, sim_x)
            facility = torch.cat([self.self_sim - nearest_with_x, self_x - sim_x.amax(dim=-1, keepdim=True)], dim=1)
            facility = facility.clamp_(min=0).double()
            facility_total = self.self_sim.sum(dim=-1, keepdim=True, dtype=torch.float64) + self_x  # f_FL(S') on S'
            valid_all = torch.cat([self.valid, valid_x], dim=1)
            mass = weights.gather(1, ground).double().mul_(valid_all)
            total = mass.sum(dim=-1, keepdim=True)
            if normalise_mass:  # phi of the fraction of the ground set's attention mass
                mass = safe_divide(mass, total)
                total = (total > 0).double()
            if log_form:  # Concave.__call__ and Concave.loss of the log form
                phi_total = torch.log1p(total)
                feature = torch.log1p(mass / (total - mass).clamp_min_(0).add_(1.0))
            else:  # Concave.__call__ and Concave.loss, both phi values from one Newton loop
                values = phi(torch.cat([total, (total - mass).clamp_min_(0)], dim=1))
                phi_total = values[:, :1]
                feature = phi_total - values[:, 1:]
            # safe_divide's values with fewer ops: phi_total is 0 or more, and the feature term 0
            # where it is 0; f_FL(S') is 0 only where every facility gain is 0 too (each is at most
            # its element's sim(v, v)), so its plain quotient by the clamped total is already 0 there.
            feature = feature.div_(phi_total if unclamped_phi else phi_total.clamp_min(1e-300))
            feature = feature.masked_fill_(phi_total <= 0, 0.0)
            gains = facility.div_(facility_total.clamp_min_(1e-300)).mul_(lam).add_(feature.mul_(1.0 - lam))
            drop = torch.where(valid_all, gains, float("-inf")).argmin(dim=-1, keepdim=True)  # == size: x goes

            # x takes the slot y of the dropped member (rows where x itself goes keep their state:
            # every update below is a no-op there).
            replace = drop < size  # [R, 1]
            if active is not None:
                replace = replace & active
            y = drop.clamp_(max=size - 1)
            # The slot x takes, as a mask that is all False where nothing changes: each O(T) field is
            # then written by one select (no gather of the old value, no scatter, no row mask).
            at_y = slots == y
            taken = replace & at_y
            dropped.append(torch.where(replace, member_index.gather(1, y), x))
            # The members whose nearest one may have left: y attains their maximum (a tie rescans to
            # the same value), and x itself. Read before x's column overwrites y's.
            column = self.sim.take_along_dim(y[:, :, None], dim=2).view(rows, size)
            rescan = (column >= self.nearest).logical_and_(replace).logical_or_(taken)
            # Write x's row and column of the cached matrix (O(T)); its diagonal entry is zero. Rows
            # where nothing joins write zeros onto the diagonal instead (entry j to (j, j), where the
            # matrix holds 0): they keep every other value, also of a matrix that one product's
            # rounding left not exactly symmetric, so the nearest values (read off its rows) stay
            # its row maxima.
            target = torch.where(replace, y, slots)
            new_row = sim_x.mul_(replace).masked_fill_(at_y, 0.0)
            self.sim.scatter_(1, target.view(rows, 1, size), new_row.view(rows, 1, size))
            self.sim.scatter_(2, target.view(rows, size, 1), new_row.view(rows, size, 1))
            for field, value in ((self.self_sim, self_x), (self.norms, norm_x), (self.valid, valid_x)):
                torch.where(taken, value, field, out=field)  # in place: no copy back
            if by_rank or joiner is not None:  # x a stored index per row
                torch.where(taken, x, member_index, out=member_index)
            else:
                member_index.masked_fill_(taken, x)
            # Nearest other member: x beats the old one, or the old one stays, except for the rows
            # rescanned. Every row is scanned and the rescanned ones taken (masked work over the
            # fixed T x T bound, Appx. E's O(T^2) per step): selecting the rows would be a host read.
            # Only the value is kept: which member attains it is read off the matrix when one leaves.
            torch.where(replace, nearest_with_x, self.nearest, out=self.nearest)
            torch.where(rescan, self.sim.amax(dim=-1), self.nearest, out=self.nearest)
            # x is the newest member: its slot moves to the last rank, the later ones move up.
            later = (self.rank_of_slot > self.rank_of_slot.gather(1, y)).logical_and_(replace)
            self.rank_of_slot.add_(later, alpha=-1).masked_fill_(taken, size - 1)
        # rank_of_slot is a permutation of each row: the scatter writes every entry of its inverse.
        self.slot_of_rank.scatter_(1, self.rank_of_slot, slots.expand(rows, size))
        member_index = member_index.gather(1, self.slot_of_rank)  # by rank
        if positions.dtype == self.positions.dtype:
            torch.gather(positions, 1, member_index, out=self.positions)
        else:
            self.positions.copy_(positions.gather(1, member_index))
        return dropped[0] if joiners == 1 else torch.cat(dropped, dim=1)

    @classmethod
    def empty(cls, rows: int, size: int, device) -> StreamingSummary:
        """A summary of ``size`` slots holding no members yet (zeros; unit norms), to be filled in
        place by :meth:`assign_where` (a layer in a fixed decode capacity whose prompt fit its budget)."""
        order = torch.arange(size, device=device).expand(rows, size)
        zeros = torch.zeros(rows, size, device=device)
        return cls(
            torch.zeros(rows, size, size, device=device),
            zeros.clone(),
            zeros.clone(),
            torch.ones(rows, size, device=device),
            torch.zeros(rows, size, dtype=torch.bool, device=device),
            order.clone(),
            order.clone(),
            torch.zeros(rows, size, dtype=torch.int32, device=device),
        )

    def assign_where(self, condition: torch.Tensor, other: StreamingSummary) -> None:
        """Take ``other``'s state where ``condition`` (a device bool) holds, in place."""
        for field in dataclasses.fields(self):
            mine = getattr(self, field.name)
            mine.copy_(torch.where(condition, getattr(other, field.name), mine))

    def assign_rows(self, rows: torch.Tensor, other: StreamingSummary) -> None:
        """Take ``other``'s state in the rows where ``rows`` (``[R]`` device bool) holds, in place."""
        for field in dataclasses.fields(self):
            mine = getattr(self, field.name)
            condition = rows.view(-1, *([1] * (mine.dim() - 1)))
            mine.copy_(torch.where(condition, getattr(other, field.name), mine))

    def mark_static(self) -> None:
        """Fix the state's addresses for a compiled decode step (updates are in place)."""
        for field in dataclasses.fields(self):
            torch._dynamo.mark_static_address(getattr(self, field.name))

    def nbytes(self) -> int:
        """Bytes held: the ``T x T`` similarity matrix plus ``O(T)`` per row (at most a ``k x k``
        matrix per row for a budget ``k``, never the stored tokens' ``N x N``)."""
        return sum(getattr(self, field.name).nbytes for field in dataclasses.fields(self))

    def matches(self, positions: torch.Tensor) -> torch.Tensor:
        """0-d device bool: the first ``T`` stored tokens are this summary's members
        (``positions[R, >=T]``), computed without a host read."""
        size = self.size
        if positions.shape[-1] < size:
            return torch.zeros((), dtype=torch.bool, device=positions.device)
        return (positions[:, :size] == self.positions).all()

    def aligned_with(self, positions: torch.Tensor) -> bool:
        """Whether the first ``T`` stored tokens are this summary's members (a host read)."""
        return bool(self.matches(positions))

    @classmethod
    def concatenate(cls, parts: list[StreamingSummary]) -> StreamingSummary:
        """Rows of several summaries (same ``T``) stacked in order."""
        if len(parts) == 1:
            return parts[0]
        fields = [field.name for field in dataclasses.fields(cls)]
        return cls(**{name: torch.cat([getattr(part, name) for part in parts], dim=0) for name in fields})
