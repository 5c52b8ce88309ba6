"""The optimizer state of a shard's units, per key: out (checkpoints, GetState), in (SetState), undo, digest.

:class:`~shardps.server.dense.optimizer.ShardOptimizer` steps one tensor per
chunk ("unit"); checkpoints and the wire carry one entry per key, so this
mixin joins a key's units on the way out and splits them on the way in. It
also keeps the copies a streamed round needs to undo what it applied
(``save_units`` / ``restore_units``, ``shardps.server.consistency.streamed``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection

import torch

from shardps.common.codec import finite

#: Elements of each scratch parameter the join-time trial step runs on.
TRIAL_ELEMENTS = 64
IMPL_KEYS = ("params", "fused", "foreach")


class StateError(ValueError):
    """Optimizer state to load that does not fit this shard's parameters or optimizer."""




def per_element_entries(state: dict, numel: int) -> dict:
    """The entries of one parameter's optimizer state that hold one value per element."""
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.numel() == numel and v.dim() == 1}


class UnitState:
    """State in and out of a :class:`~shardps.server.dense.optimizer.ShardOptimizer`, per key (a mixin: it uses the
    optimizer's ``optimizer``, ``views``, ``slices``, ``unit_slices``, ``units_of_key``, ``params`` and ``groups``)."""

    def save_units(self, units: Collection[int]) -> list[tuple[int, torch.Tensor, dict | None]]:
        """Copies of ``units``' parameters and optimizer state, for :meth:`restore_units` to put back.

        A round applied a chunk at a time keeps these until it completes, so that
        a round refused after some chunks were applied is undone (memory: the
        units' parameters and per-element state once more).
        """
        if self.optimizer is None:
            return []
        out = []
        for u in units:
            view = self.views[u]
            state = self.optimizer.state.get(view)
            out.append((u, view.clone(), {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in state.items()}
                        if state else None))
        return out

    def restore_units(self, saved: list[tuple[int, torch.Tensor, dict | None]]) -> None:
        """Put back what :meth:`save_units` copied (parameters, state, step counts; fresh state is removed)."""
        for u, param, state in reversed(saved):
            view = self.views[u]
            view.copy_(param)
            if state is None:
                self.optimizer.state.pop(view, None)
            else:
                self.optimizer.state[view] = state
        if saved:
            self._bounds.clear()  # measured afresh before the next proof


    # ------------------------------------------------------------------ state
    def state_bytes(self) -> int:
        """Bytes of optimizer state (moments, momentum buffers, step counters)."""
        if self.optimizer is None:
            return 0
        return sum(
            v.numel() * v.element_size()
            for st in self.optimizer.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor)
        )

    def get_state(self) -> dict[int, dict[str, torch.Tensor]]:
        """``{key index: {name: tensor}}`` of every key that has optimizer state (copies)."""
        if self.optimizer is None:
            return {}
        return {k: self._key_state(k) for k, units in self.units_of_key.items()
                if self.optimizer.state.get(self.views[units[0]])}

    def _key_state(self, k: int) -> dict[str, torch.Tensor]:
        """Key ``k``'s state as one tensor per entry (per-element entries: its units' joined; scalars: the first's)."""
        units = self.units_of_key[k]
        first = self.optimizer.state[self.views[units[0]]]
        per_element = per_element_entries(first, self.views[units[0]].numel())
        out = {}
        for name, v in first.items():
            if not isinstance(v, torch.Tensor):
                continue
            if name in per_element:
                out[name] = torch.cat([self.optimizer.state[self.views[u]][name] for u in units])
            else:
                out[name] = v.detach().clone()
        return out

    def expected_state(self, group: int) -> tuple[set[str], set[str]]:
        """``(per-element names, scalar names)`` this optimizer keeps for a parameter of ``group``."""
        local = self.groups.index(group)
        p = torch.zeros(TRIAL_ELEMENTS)
        hyper = {k: v for k, v in self.optimizer.param_groups[local].items() if k not in IMPL_KEYS}
        impl = {"fused": True} if self.optimizer.defaults.get("fused") else {"foreach": True}
        opt = type(self.optimizer)([{"params": [p], **hyper}], **impl)
        p.grad = torch.ones_like(p)
        opt.step()
        state = opt.state[p]
        per_element = set(per_element_entries(state, TRIAL_ELEMENTS))
        return per_element, {k for k, v in state.items() if isinstance(v, torch.Tensor)} - per_element

    def load_state(self, states: dict[int, dict[str, torch.Tensor]], compare_only: bool = False) -> bool:
        """Replace the optimizer state of every key, all or nothing.

        Args:
            states: ``{key index: {name: tensor}}``; a key left out has no state
                (it was never stepped). Per-element entries are 1-D with the
                key's slice length, scalar entries hold one element.
            compare_only: check and compare, change nothing.

        Returns:
            True if the new state differs from the current one.

        Raises:
            StateError: an unknown key or entry name, a wrong size, a missing
                entry, or a non-finite value.
        """
        if self.optimizer is None:
            if states:
                raise StateError("state for keys this shard does not hold (it holds no parameter elements)")
            return False
        expected = {g: self.expected_state(g) for g in self.groups}
        new = {}
        for k, st in states.items():
            if k not in self.units_of_key:
                raise StateError(f"state for key index {k}, which this shard does not hold")
            group, start, end = self.slices[k]
            view = self.params[group][start:end]
            per_element, scalars = expected[group]
            if set(st) != per_element | scalars:
                raise StateError(f"state of key index {k} has entries {sorted(st)}; this optimizer keeps "
                                 f"{sorted(per_element | scalars)}")
            for name, value in st.items():
                want = view.numel() if name in per_element else 1
                if value.numel() != want:
                    raise StateError(f"state {name!r} of key index {k} has {value.numel()} values, not {want}")
                if value.is_floating_point() and not finite(value.reshape(-1)):
                    raise StateError(f"state {name!r} of key index {k} holds NaN or Inf")
            for u in self.units_of_key[k]:
                _, u_start, u_end = self.unit_slices[u]
                new[self.views[u]] = {
                    name: v.reshape(-1)[u_start - start : u_end - start].clone() if name in per_element
                    else v.reshape(()).clone() for name, v in st.items()}
        current = self.optimizer.state
        changed = set(new) != {v for v, st in current.items() if st} or any(
            set(st) != set(current[v]) or any(not torch.equal(st[n], current[v][n]) for n in st)
            for v, st in new.items()
        )
        if changed and not compare_only:
            current.clear()
            current.update(new)
            self._bounds.clear()
        return changed

    def digest(self, version: int) -> str:
        """SHA-256 (hex) of ``version``, every parameter byte and every optimizer-state value, in key order."""
        h = hashlib.sha256(version.to_bytes(8, "little"))
        for k in sorted(self.units_of_key):
            group, start, end = self.slices[k]
            h.update(self.params[group][start:end].numpy().tobytes())
            has = self.optimizer is not None and self.optimizer.state.get(self.views[self.units_of_key[k][0]])
            state = self._key_state(k) if has else {}
            for name in sorted(state):
                v = state[name]
                h.update(name.encode())
                h.update(v.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if isinstance(v, torch.Tensor)
                         else repr(v).encode())
        return h.hexdigest()
