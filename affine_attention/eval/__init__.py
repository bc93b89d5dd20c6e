"""Evaluation: perplexity on raw text and zero-shot tasks through lm-evaluation-harness (offline fixtures included).

Cheap to import: torch, transformers and lm-eval load inside the functions that use them.
"""

from .harness import evaluate
from .results import format_table, write_results
from .tasks import (
    FIXTURE_PPL_TASK,
    FIXTURE_TASKS,
    PAPER_TASKS,
    TaskDataUnavailableError,
    expand_tasks,
    materialize_fixture_tasks,
)

# Imported last and by name: this rebinds `affine_attention.eval.perplexity` from the submodule
# of the same name to the function.
from .perplexity import perplexity, read_texts

__all__ = [
    "FIXTURE_PPL_TASK",
    "FIXTURE_TASKS",
    "PAPER_TASKS",
    "TaskDataUnavailableError",
    "evaluate",
    "expand_tasks",
    "format_table",
    "materialize_fixture_tasks",
    "perplexity",
    "read_texts",
    "write_results",
]
