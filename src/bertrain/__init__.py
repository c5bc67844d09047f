"""bertrain: train BERT end to end, from raw text to fine-tuned, evaluated models."""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public API, imported lazily so `import bertrain` stays cheap (the CLI imports only what a command needs).
_EXPORTS = {
    "BertConfig": "bertrain.model.bert",
    "BertModel": "bertrain.model.bert",
    "BertForPreTraining": "bertrain.model.bert",
    "BertForQuestionAnswering": "bertrain.model.bert",
    "BertForSequenceClassification": "bertrain.model.bert",
}

__all__ = ["__version__", *_EXPORTS]


def __dir__() -> list[str]:
    """The lazy exports too, so that completion (IPython, editors) offers them before their first use."""
    return sorted({*globals(), *_EXPORTS})


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'bertrain' has no attribute {name!r}")
