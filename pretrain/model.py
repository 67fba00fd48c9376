"""BERT for pretraining: HF ``BertForPreTraining`` built from a preset, and a loss wrapper
that runs the MLM head on masked positions only (NVIDIA's trick: the vocabulary projection
of unmasked positions is wasted work and memory)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import BertConfig, BertForPreTraining

from pretrain.config import ModelConfig
from pretrain.packing import attention_mask as packed_attention_mask

# (layers, hidden, heads); intermediate = 4 x hidden, as in Google's BERT releases.
PRESET_SHAPES = {
    "bert-tiny": (2, 128, 2),
    "bert-mini": (4, 256, 4),
    "bert-small": (4, 512, 8),
    "bert-base": (12, 768, 12),
    "bert-large": (24, 1024, 16),
}
POSITION_EMBEDDINGS = "bert.embeddings.position_embeddings.weight"


def bert_config(cfg: ModelConfig, vocab_size: int, pad_token_id: int = 0) -> BertConfig:
    layers, hidden, heads = PRESET_SHAPES[cfg.preset]
    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=cfg.max_position_embeddings,
        hidden_dropout_prob=cfg.dropout,
        attention_probs_dropout_prob=cfg.dropout,
        pad_token_id=pad_token_id,
        attn_implementation=cfg.attention,
    )


def build_model(cfg: ModelConfig, vocab_size: int, pad_token_id: int = 0) -> BertForPreTraining:
    """A freshly initialised model for a tokenizer of ``vocab_size`` tokens, with
    ``cfg.vocab_size`` rows if set (``init_from`` is applied by the trainer)."""
    if cfg.vocab_size is not None and cfg.vocab_size < vocab_size:
        raise ValueError(
            f"model.vocab_size is {cfg.vocab_size}, but the tokenizer has {vocab_size} "
            f"tokens: set it to at least {vocab_size}, or leave it unset"
        )
    return BertForPreTraining(bert_config(cfg, cfg.vocab_size or vocab_size, pad_token_id))


def compile_body(model: BertForPreTraining, mode: str) -> None:
    """Compile ``model``'s BERT body in place with ``torch.compile`` in ``mode``
    (``model.compile``; "off": nothing). In place, so parameter names, checkpoints and the
    exported model stay those of the eager model."""
    if mode != "off":
        model.bert.compile(mode=mode)


def untrained_position_rows(model: BertForPreTraining, seq_length: int) -> dict[str, torch.Tensor]:
    """Position embeddings beyond the phase's sequence length get no gradient: their rows,
    as a momentum mask for optimizers that would otherwise move them."""
    table = dict(model.named_parameters())[POSITION_EMBEDDINGS]
    if seq_length >= table.shape[0]:
        return {}
    mask = torch.ones(table.shape[0], 1, device=table.device)
    mask[seq_length:] = 0.0
    return {POSITION_EMBEDDINGS: mask}


class PretrainingLoss(nn.Module):
    """``forward(batch)`` → (loss, statistics) for MLM + NSP, heads on masked positions only.

    Statistics are sums (masked tokens, correct predictions, ...) so they can be added up
    over micro-batches and ranks before dividing.
    """

    def __init__(self, model: BertForPreTraining):
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids,
        token_type_ids,
        attention_mask,
        mlm_labels,
        nsp_labels,
        mlm_positions=None,
        nsp_rows=None,
        position_ids=None,
        sequence_ids=None,
        nsp_positions=None,
    ):
        """``mlm_positions`` (flat indices of the labelled tokens, in row order) and
        ``nsp_rows`` (rows with an NSP label) are found on the host by ``make_batch``;
        without them they are found here from the labels, which makes the host wait for
        the device. Either way the same elements are selected in the same order.

        A packed micro-batch (:mod:`pretrain.packing`) gives ``position_ids`` and
        ``sequence_ids`` instead of ``attention_mask``, and ``nsp_positions`` (each labelled
        sequence's ``[CLS]``, flat) with one ``nsp_labels`` entry per sequence: attention
        stays within each sequence and the NSP head pools each sequence's own ``[CLS]``."""
        if sequence_ids is not None:
            return self._packed(
                input_ids, token_type_ids, mlm_labels, nsp_labels, mlm_positions,
                position_ids, sequence_ids, nsp_positions,
            )  # fmt: skip
        bert = self.model.bert(
            input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask
        )
        sequence, pooled = bert[0], bert[1]
        return self._heads(sequence, pooled, input_ids, mlm_labels, nsp_labels, mlm_positions,
                           nsp_rows)  # fmt: skip

    def _packed(self, input_ids, token_type_ids, mlm_labels, nsp_labels, mlm_positions,
                position_ids, sequence_ids, nsp_positions):  # fmt: skip
        eager = self.model.config._attn_implementation == "eager"
        mask = packed_attention_mask(sequence_ids, self.model.dtype if eager else None)
        bert = self.model.bert(input_ids=input_ids, token_type_ids=token_type_ids,
                               attention_mask=mask, position_ids=position_ids)  # fmt: skip
        sequence = bert[0]
        if nsp_positions is None:
            nsp_positions = torch.zeros(0, dtype=torch.long, device=input_ids.device)
        cls = sequence.reshape(-1, sequence.shape[-1]).index_select(0, nsp_positions)
        pooler = self.model.bert.pooler
        pooled = pooler.activation(pooler.dense(cls))
        rows = torch.arange(nsp_labels.numel(), device=input_ids.device)
        return self._heads(sequence, pooled, input_ids, mlm_labels, nsp_labels, mlm_positions,
                           rows)  # fmt: skip

    def _heads(self, sequence, pooled, input_ids, mlm_labels, nsp_labels, mlm_positions,
               nsp_rows):  # fmt: skip
        if mlm_positions is None:
            mlm_positions = (mlm_labels.reshape(-1) != -100).nonzero().squeeze(1)
        if nsp_rows is None:
            nsp_rows = (nsp_labels >= 0).nonzero().squeeze(1)
        targets = mlm_labels.reshape(-1).index_select(0, mlm_positions)
        hidden = sequence.reshape(-1, sequence.shape[-1]).index_select(0, mlm_positions)
        logits = self.model.cls.predictions(hidden)
        mlm_loss = nn.functional.cross_entropy(logits.float(), targets)
        stats = {
            "mlm_loss_sum": mlm_loss.detach() * targets.numel(),
            "mlm_tokens": torch.tensor(float(targets.numel()), device=input_ids.device),
            "mlm_correct": (logits.argmax(-1) == targets).sum().float(),
        }
        loss = mlm_loss
        if nsp_rows.numel() > 0:  # a shape: known on the host
            nsp_targets = nsp_labels.index_select(0, nsp_rows)
            nsp_logits = self.model.cls.seq_relationship(pooled.index_select(0, nsp_rows))
            nsp_logits = nsp_logits.float()
            nsp_loss = nn.functional.cross_entropy(nsp_logits, nsp_targets)
            loss = loss + nsp_loss
            stats["nsp_loss_sum"] = nsp_loss.detach() * nsp_targets.numel()
            stats["nsp_examples"] = torch.tensor(
                float(nsp_targets.numel()), device=input_ids.device
            )
            stats["nsp_correct"] = (nsp_logits.argmax(-1) == nsp_targets).sum().float()
        else:  # MLM-only data; keep the NSP head in the graph with a zero contribution
            loss = loss + 0.0 * self.model.cls.seq_relationship(pooled).sum()
        return loss, stats


def load_weights(model: BertForPreTraining, source: str | Path) -> None:
    """Weights from an HF-format directory (``save_pretrained``) into ``model``."""
    pretrained = BertForPreTraining.from_pretrained(str(source))
    missing, unexpected = model.load_state_dict(pretrained.state_dict(), strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{source} does not fit this model: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}; check model.preset"
        )
