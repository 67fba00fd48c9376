"""Packed sequences (``data.packing``): a micro-batch's sequences placed end to end in as
few rows as fit, as MLPerf's BERT does, so that the model spends no work on padding.

Each sequence keeps its tokens, its masked positions, its segment (token type) ids and its
next-sentence label; in the packed row it gets positions that start again at 0 and a
*sequence id* (1, 2, ... within the row; 0 for the padding that is left). Attention stays
within a sequence (:func:`attention_mask` builds the block-diagonal mask from the ids), so
every sequence's hidden states are those it has alone, and the MLM and NSP losses are the
same means over the same masked tokens and the same labelled sequences: packing changes the
shape of the work, not the step. The NSP head reads each sequence's own ``[CLS]``
(``nsp_positions``: flat indices into the packed rows).

Rows are filled first-fit in order of decreasing length, deterministically (ties keep the
micro-batch's order). The number of rows varies from micro-batch to micro-batch.
"""

from __future__ import annotations

import numpy as np
import torch


def pack_order(lengths: np.ndarray, seq_length: int) -> list[list[int]]:
    """Rows as lists of sequence indices: first-fit in order of decreasing length (a stable
    sort), each row's lengths adding up to at most ``seq_length``."""
    order = np.argsort(-np.asarray(lengths), kind="stable")
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        need = int(lengths[i])
        if need > seq_length:
            raise ValueError(f"a sequence of {need} tokens does not fit rows of {seq_length}")
        for r, free in enumerate(room):
            if need <= free:
                rows[r].append(int(i))
                room[r] -= need
                break
        else:
            rows.append([int(i)])
            room.append(seq_length - need)
    return rows


def pack_batch(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The packed form of a ``make_batch`` micro-batch: ``input_ids``, ``token_type_ids``,
    ``mlm_labels``, ``position_ids``, ``sequence_ids`` and ``attention_mask`` (1 on every
    sequence's tokens; the model attends by ``sequence_ids``) of shape (rows, seq_length);
    ``mlm_positions`` (flat indices of the labelled tokens, row by row), ``nsp_labels`` (one
    per sequence with a label, in the packed order) and ``nsp_positions`` (the flat index of
    each of those sequences' ``[CLS]``). Sequences are left-aligned in their rows
    (``attention_mask`` 1 then 0), as the shards give them."""
    input_ids, mask = batch["input_ids"], batch["attention_mask"]
    n, seq_length = input_ids.shape
    lengths = mask.sum(axis=1).astype(np.int64)
    rows = pack_order(lengths, seq_length)
    shape = (len(rows), seq_length)
    out = {
        "input_ids": np.zeros(shape, dtype=input_ids.dtype),
        "token_type_ids": np.zeros(shape, dtype=batch["token_type_ids"].dtype),
        "mlm_labels": np.full(shape, -100, dtype=batch["mlm_labels"].dtype),
        "position_ids": np.zeros(shape, dtype=np.int64),
        "sequence_ids": np.zeros(shape, dtype=np.int64),
    }
    nsp_labels, nsp_positions = [], []
    for r, members in enumerate(rows):
        start = 0
        for k, i in enumerate(members, start=1):
            end = start + int(lengths[i])
            out["input_ids"][r, start:end] = input_ids[i, : end - start]
            out["token_type_ids"][r, start:end] = batch["token_type_ids"][i, : end - start]
            out["mlm_labels"][r, start:end] = batch["mlm_labels"][i, : end - start]
            out["position_ids"][r, start:end] = np.arange(end - start)
            out["sequence_ids"][r, start:end] = k
            if batch["nsp_labels"][i] >= 0:
                nsp_labels.append(batch["nsp_labels"][i])
                nsp_positions.append(r * seq_length + start)
            start = end
    out["attention_mask"] = (out["sequence_ids"] > 0).astype(mask.dtype)  # for the record
    out["mlm_positions"] = np.flatnonzero(out["mlm_labels"] != -100)
    out["nsp_labels"] = np.asarray(nsp_labels, dtype=batch["nsp_labels"].dtype)
    out["nsp_positions"] = np.asarray(nsp_positions, dtype=np.int64)
    return out


def attention_mask(sequence_ids: torch.Tensor, additive_dtype: torch.dtype | None = None):
    """The block-diagonal mask of packed rows, shape (rows, 1, L, L): a token attends to the
    tokens of its own sequence; the padding attends to the padding (so that no query has
    nothing to attend to). Boolean (True: attend) for SDPA; with ``additive_dtype``, the
    additive form eager attention adds to its scores (0 or the dtype's minimum)."""
    allowed = (sequence_ids[:, :, None] == sequence_ids[:, None, :])[:, None]
    if additive_dtype is None:
        return allowed
    blocked = torch.zeros(allowed.shape, dtype=additive_dtype, device=allowed.device)
    return blocked.masked_fill(~allowed, torch.finfo(additive_dtype).min)
