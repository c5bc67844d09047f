"""The BERT model (`bert.py`) and its Hugging Face interchange (`hf.py`)."""
from bertrain.model.bert import (
    PRESETS,
    BertConfig,
    BertForPreTraining,
    BertForPreTrainingOutput,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertModel,
    BertModelOutput,
    BertPreTrainedModel,
    QuestionAnsweringOutput,
    SequenceClassifierOutput,
)

__all__ = [
    "PRESETS", "BertConfig", "BertModel", "BertForPreTraining", "BertForSequenceClassification",
    "BertForQuestionAnswering", "BertPreTrainedModel", "BertModelOutput", "BertForPreTrainingOutput",
    "SequenceClassifierOutput", "QuestionAnsweringOutput",
]
