"""A sequence classification head on the mean of the encoder's token states.

HF's ``BertForSequenceClassification`` classifies from the pooled ``[CLS]`` state: a dense
layer and tanh that BERT's next-sentence task trains in pretraining. A checkpoint pretrained
on MLM alone (full sentences, no NSP, as RoBERTa and this project's parity regime do) has an
untrained pooler and a ``[CLS]`` state nothing asked to summarise the sentence, so with
small fine-tuning sets the head learns the pooling from scratch and the pretrained token
states count for little. :class:`MeanPoolingClassifier` instead averages the last layer's
states over the real tokens (the attention mask) and applies dropout and one linear layer
(``finetune.pooling: mean``); the loss is cross-entropy, or mean squared error for
regression (one output), as HF's head computes them.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_outputs import SequenceClassifierOutput


class MeanPoolingClassifier(nn.Module):
    """``encoder`` (an HF ``BertModel``) → masked mean of its last hidden states →
    dropout → linear to ``num_labels`` outputs. Its forward returns ``.loss`` (given
    ``labels``) and ``.logits``, like an HF model."""

    def __init__(self, encoder: nn.Module, num_labels: int, dropout: float | None = None):
        super().__init__()
        self.bert = encoder
        config = encoder.config
        self.config = config
        self.num_labels = num_labels
        rate = config.hidden_dropout_prob if dropout is None else dropout
        self.dropout = nn.Dropout(rate)
        self.classifier = nn.Linear(config.hidden_size, num_labels)
        self.classifier.weight.data.normal_(mean=0.0, std=config.initializer_range)
        self.classifier.bias.data.zero_()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> SequenceClassifierOutput:
        states = self.bert(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(states.dtype)
        pooled = (states * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        logits = self.classifier(self.dropout(pooled))
        loss = None
        if labels is not None:
            if self.num_labels == 1:
                loss = nn.functional.mse_loss(logits.squeeze(-1).float(), labels.float())
            else:
                loss = nn.functional.cross_entropy(logits.float(), labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)
