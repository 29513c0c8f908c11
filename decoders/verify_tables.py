"""The bias tables of the verify loop's calls: T5's relative bias of every distance a call can
meet, made once per weights, and per number of fed tokens the index tables a call gathers with
(rows at different counts) or the slice every row reads (rows at one count)."""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from decoders.backbone import HeadTable, made_from_bias_weight, past_distance_bias_table


@functools.lru_cache(maxsize=16)
def call_index_tables(k: int, most_slots: int, device: torch.device):
    """Index tables of a decode, made once per shape (they hold no weights): for a call of Q fed
    tokens (1 up to k), each token's fed index (Q,), fed index - slot (Q, most_slots) (the
    distances, once a row's count is added) and Q itself (0-dim: "no end token among them")."""
    fed_offset = torch.arange(k, device=device)
    query_minus_slot = fed_offset[:, None] - torch.arange(most_slots, device=device)
    return {q: (fed_offset[:q], query_minus_slot[:q], torch.tensor(q, device=device))
            for q in range(1, k + 1)}


class CallTables(NamedTuple):
    """What a call of Q fed tokens indexes with, made once per weights (`bias_tables`)."""

    fed_offset: torch.Tensor     # (Q,) each fed token's index: its position is the row's count + it
    based_offsets: torch.Tensor  # (heads, Q, slots) fed index - slot, each head's base added: a
                                 # row's bias indices once its count is added
    no_end: torch.Tensor         # 0-dim Q: "no end token among them"
    one_count: torch.Tensor      # (1, heads, Q, bound - 1 + Q) the bias of every row at one count
                                 # c: its columns bound - 1 - c .. bound - 2 + Q, slots 0 .. c + Q - 1


def bias_tables(model, bound: int, k: int, device: torch.device) -> tuple[HeadTable, "CallTablesByWidth"]:
    """T5's bias of every distance a call can meet (each call only gathers from it, or slices it),
    and per number of fed tokens Q (1 .. k) the call's `CallTables`, made at the first call of that
    width; both made once per weights while decoding (`made_from_bias_weight`). Query positions
    reach bound + k - 2; a slot in a query's future (a negative distance, down to -(bound + k))
    reads a hidden entry, the dtype's lowest."""
    def make() -> tuple[HeadTable, CallTablesByWidth]:
        far = bound + k
        past = past_distance_bias_table(model, far)                     # (far + 1, heads): 0..far
        hidden_slots = past.new_full((far, past.size(1)), torch.finfo(past.dtype).min)
        table = HeadTable.of(torch.cat([hidden_slots, past]).T, origin=far)   # distance -far..far
        return table, CallTablesByWidth(table, bound, call_index_tables(k, far, device))
    return made_from_bias_weight(model, ("verify calls", bound, k, device), make)


class CallTablesByWidth(dict):
    """Q -> `CallTables`, each made when a call of Q fed tokens first needs it: a decode whose
    drafts rarely pass feeds one token per call, and pays for no wider call's tables."""

    def __init__(self, table: HeadTable, bound: int, index_tables: dict):
        super().__init__()
        self.table, self.bound, self.index_tables = table, bound, index_tables

    def __missing__(self, queries: int) -> CallTables:
        fed_offset, query_minus_slot, no_end = self.index_tables[queries]
        # fed index - (slot - c), for slot - c from -(bound - 1) (the first slot of a row at the
        # highest count) to Q - 1
        relative = fed_offset[:, None] - torch.arange(1 - self.bound, queries, device=fed_offset.device)
        tables = CallTables(fed_offset, self.table.base + query_minus_slot, no_end,
                            self.table.gather(self.table.base + relative)[None])
        self[queries] = tables
        return tables
