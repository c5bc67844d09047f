"""The BERT model (`bert.py`), how it runs (`options.py`, `unpad.py`), its losses (`losses.py`) and its Hugging Face
interchange (`hf.py`)."""
# hf.py installs `from_pretrained` / `save_pretrained` on the model classes (it imports bert.py, not the reverse);
# importing it here makes them present whichever bertrain.model module is imported first.
from bertrain.model import hf  # noqa: F401
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
