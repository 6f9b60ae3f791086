"""``data.name = "table"``: CSV and Parquet tables, in memory or streamed.

Modules, each importing only those above it: :mod:`.files` (which files, their columns and rows),
:mod:`.plan` (the columns' roles and the task), :mod:`.split` (which rows are validation rows),
:mod:`.preprocess` (fitted standardisation, fill values, vocabularies), :mod:`.memory` (the table
held whole), :mod:`.stream` (Parquet row group by row group) and :mod:`.build` (the entry point).
"""

from __future__ import annotations

from vatra.data.tabular.build import build_table, check_table
from vatra.data.tabular.memory import RankingDataset, TableDataset
from vatra.data.tabular.preprocess import Preprocess
from vatra.data.tabular.stream import ParquetStream

__all__ = [
    "ParquetStream",
    "Preprocess",
    "RankingDataset",
    "TableDataset",
    "build_table",
    "check_table",
]
