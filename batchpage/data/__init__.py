"""Reading prompts: the dataset spec and its checks (spec), the format readers (readers), one
row's prompt and overrides (rows) and the bundled datasets (presets)."""

from batchpage.data.readers import DatasetError
from batchpage.data.rows import Row
from batchpage.data.spec import DatasetInfo, DatasetSpec, iter_rows, iter_windows, validate

__all__ = [
    "DatasetError",
    "DatasetInfo",
    "DatasetSpec",
    "Row",
    "iter_rows",
    "iter_windows",
    "validate",
]
