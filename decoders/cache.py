"""The decoder's key/value cache, written where each call says.

Every decoding loop passes the model step the slots its fed tokens' keys and values go to
(`Slots`), as gpt-fast's cache update takes the input positions: the cache keeps no state of a
call. The encoder's keys and values are computed at a decode's first call and kept, or, in a
loop compiled for fixed shapes, before it (`backbone.fixed_shape_start`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class Slots(NamedTuple):
    """Where one call writes its Q fed tokens in every layer's self-attention cache.

    Either every row at `start` .. start + Q - 1, after the slots before `start` (what lay at or
    past it, a rejected draft's, is dropped first): the call's keys are the stored tensor itself;
    or each row at its own slots `each` (live, Q) of a buffer, and the call attends slots
    0 .. width - 1 (a row whose tokens sit lower leaves slots in their future, which its bias hides).
    """

    start: int | None = None
    each: torch.Tensor | None = None   # (live, Q) each row's slots
    rows: torch.Tensor | None = None   # (live, 1) 0 .. live - 1: the rows `each` writes
    width: int = 0


# A loop compiled for fixed shapes attends its cache in widths of this many slots: a few widths,
# each one shape.
ATTENDED_SLOTS_STEP = 32


def attended_width(slots: int, most_slots: int) -> int:
    """The width a fixed-shape call attends to reach `slots` slots: a multiple of
    ATTENDED_SLOTS_STEP, at most `most_slots`."""
    return min(most_slots, -(-slots // ATTENDED_SLOTS_STEP) * ATTENDED_SLOTS_STEP)


def power_of_two_holding(count: int) -> int:
    """The least power of two >= `count` (>= 1): how fixed-shape calls round their rows, columns
    and source widths, so that they meet few shapes."""
    return 1 << (count - 1).bit_length()


class DecoderCache:
    """Per decoder layer: the self-attention keys and values, (B, heads, slots, d_kv) each, and the
    encoder's keys and values, computed at the first call. `most_slots` bounds the buffer of a loop
    whose rows write at their own slots: it grows by doubling up to it. A loop compiled for fixed
    shapes is given its cache made whole before its first call (`backbone.fixed_shape_start`), so
    that its calls always find one buffer shape. A family whose layers read the positions of the
    keys they attend to (UMT5) keeps them too, (B or 1, slots) (`write_positions`)."""

    def __init__(self, layers: int, most_slots: int | None = None):
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers
        self.encoder_keys_values: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * layers
        self.positions: torch.Tensor | None = None
        self.most_slots = most_slots

    def room(self, width: int) -> int:
        """The slots of a buffer grown (or made) for a call that attends `width` slots."""
        return min(self.most_slots, 2 * width)

    def held(self) -> int:
        """Slots the self-attention part holds (0 before the first write)."""
        return 0 if self.keys[0] is None else self.keys[0].size(2)

    def write(self, layer: int, slots: Slots, keys: torch.Tensor,
              values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a call's keys and values (live, heads, Q, d_kv) of decoder layer `layer` at
        `slots`; returns the keys and values the call attends to."""
        stored_keys, stored_values = self.keys[layer], self.values[layer]
        if slots.start is not None:
            if stored_keys is None:   # stored as a tensor of its own, laid out as later ones are
                keys, values = keys.contiguous(), values.contiguous()
            else:
                if stored_keys.size(2) > slots.start:
                    stored_keys = stored_keys.narrow(2, 0, slots.start)
                    stored_values = stored_values.narrow(2, 0, slots.start)
                keys = torch.cat([stored_keys, keys], dim=2)
                values = torch.cat([stored_values, values], dim=2)
            self.keys[layer], self.values[layer] = keys, values
            return keys, values
        if stored_keys is None or stored_keys.size(2) < slots.width:
            # zero-filled: an unwritten slot is hidden by the bias, but NaN garbage would survive it
            room = self.room(slots.width)
            stored_keys, stored_values = _grown(keys, stored_keys, room), _grown(values, stored_values, room)
            self.keys[layer], self.values[layer] = stored_keys, stored_values
        stored_keys[slots.rows, :, slots.each] = keys.transpose(1, 2)        # (live, Q, heads, d_kv)
        stored_values[slots.rows, :, slots.each] = values.transpose(1, 2)
        return stored_keys.narrow(2, 0, slots.width), stored_values.narrow(2, 0, slots.width)

    def write_positions(self, slots: Slots, positions: torch.Tensor) -> torch.Tensor:
        """Write a call's fed tokens' positions (B or 1, Q) at `slots`, as `write` writes their
        keys; returns the positions of the keys the call attends to."""
        stored = self.positions
        if slots.start is not None:
            if stored is not None:
                stored = stored.narrow(1, 0, min(slots.start, stored.size(1)))
                rows = max(stored.size(0), positions.size(0))
                positions = torch.cat([stored.expand(rows, -1), positions.expand(rows, -1)], dim=1)
            self.positions = positions
            return positions
        rows = slots.rows.size(0)
        if stored is None or stored.size(1) < slots.width or stored.size(0) != rows:
            # never narrower than what it holds: a call may attend fewer slots than an earlier one
            held = 0 if stored is None else stored.size(1)
            grown = positions.new_zeros(rows, max(held, self.room(slots.width)))
            if stored is not None:
                grown[:, : stored.size(1)] = stored
            stored = self.positions = grown
        stored[slots.rows, slots.each] = positions
        return stored.narrow(1, 0, slots.width)

    def encoder_part(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Decoder layer `layer`'s keys and values of the encoder's states, once computed."""
        return self.encoder_keys_values[layer]

    def keep_encoder_part(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        # a tensor of its own each, not a view of the projection that made it
        self.encoder_keys_values[layer] = keys.contiguous(), values.contiguous()

    def select_rows(self, keep: torch.Tensor) -> None:
        """Keep only the rows `keep` ((kept,) longs), in that order, in every tensor."""
        self.keys = [None if t is None else t[keep, ...] for t in self.keys]
        self.values = [None if t is None else t[keep, ...] for t in self.values]
        self.encoder_keys_values = [None if pair is None else (pair[0][keep, ...], pair[1][keep, ...])
                                    for pair in self.encoder_keys_values]
        if self.positions is not None and self.positions.size(0) > 1:
            self.positions = self.positions[keep]

    def shrink_rows(self, rows: int, moved: torch.Tensor | None, places: torch.Tensor | None,
                    written: int) -> None:
        """Rows `moved` written over rows `places` ((n,) longs each; None: none), in place, then
        the first `rows` rows kept as views of the same memory: a fixed-shape batch shrinking
        without copying the rows that stay. The self-attention parts copy their first `written`
        slots: a fixed-shape loop writes every row at the same slots, so the later ones are still
        zeros in every row."""
        per_row_positions = self.positions is not None and self.positions.size(0) > 1
        if moved is not None:
            written_parts = [part[:, :, :written] for part in (*self.keys, *self.values)]
            whole_parts = [part for pair in self.encoder_keys_values for part in pair]
            if per_row_positions:
                whole_parts.append(self.positions)
            for part in written_parts + whole_parts:
                part.index_copy_(0, places, part.index_select(0, moved))
        self.keys = [t[:rows] for t in self.keys]
        self.values = [t[:rows] for t in self.values]
        self.encoder_keys_values = [(keys[:rows], values[:rows])
                                    for keys, values in self.encoder_keys_values]
        if per_row_positions:
            self.positions = self.positions[:rows]

    def gather_slots(self, order: torch.Tensor) -> None:
        """Keep, for each row b, the self-attention slots `order[b]` ((live, K') longs), in that
        order, in every layer: drops slots a row does not need and packs the rest to the front."""
        first = self.keys[0]
        # every layer's keys and values have one shape (B, heads, K, head_dim): one index serves all
        index = order[:, None, :, None].expand(-1, first.size(1), -1, first.size(-1))
        self.keys = [t.gather(2, index) for t in self.keys]
        self.values = [t.gather(2, index) for t in self.values]
        if self.positions is not None:
            self.positions = self.positions.expand(len(order), -1).gather(1, order)


def _grown(like: torch.Tensor, buffer: torch.Tensor | None, slots: int) -> torch.Tensor:
    """A zero buffer of `slots` slots shaped as `like` (live, heads, Q, d_kv), holding `buffer`'s."""
    grown = like.new_zeros(like.shape[:2] + (slots,) + like.shape[3:])
    if buffer is not None:
        grown[:, :, : buffer.size(2)] = buffer
    return grown
