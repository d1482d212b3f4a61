"""Tables (CSV, TSV, Parquet) read as columns of one length, for the converter (`python -m mwloop.data.convert`).

A CSV or TSV is read with the standard library: its first line names the columns, and each column gets the
narrowest type that holds every cell: int64, then float64 (an empty cell is NaN), then string (UTF-8). A
Parquet file is read with pyarrow when it is installed (it is not a dependency of mwloop); its columns keep
their types, strings as strings. A column of lists, structs or maps is refused in one line (flatten it first).
"""

from __future__ import annotations

import csv
import os

import numpy as np

from mwloop.errors import UserError

TABLE_SUFFIXES = (".csv", ".tsv", ".parquet", ".pq")
# What a string column's dtype is called in the manifest (numpy's "<U" widths are not stored: records hold UTF-8).
STRING = "string"


def is_table(path: str) -> bool:
    """Whether `path` names a table the converter reads (by its suffix)."""
    return path.lower().endswith(TABLE_SUFFIXES)


def read_table(path: str) -> dict[str, np.ndarray]:
    """The columns of the CSV, TSV or Parquet file `path`, by name, as numpy arrays of one length.

    Returns:
      name -> int64, float64, bool or object (str) array; Parquet's other numeric types as they are.
    Raises:
      UserError: an unreadable file, no columns, a repeated or empty column name, a row of another width,
        a nested Parquet column, or Parquet without pyarrow installed.
    """
    if not os.path.isfile(path):
        raise UserError(f"--input={path} is not a file; give a CSV, TSV or Parquet table")
    if path.lower().endswith((".parquet", ".pq")):
        return _read_parquet(path)
    return _read_csv(path, "\t" if path.lower().endswith(".tsv") else ",")


def _read_csv(path: str, delimiter: str) -> dict[str, np.ndarray]:
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f, delimiter=delimiter))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise UserError(f"--input={path} cannot be read as a table ({e}); give a UTF-8 CSV or TSV file") from None
    if not rows or not rows[0]:
        raise UserError(f"--input={path} has no header line; its first line must name the columns")
    header, body = rows[0], [row for row in rows[1:] if row]
    _check_names(path, header)
    for number, row in enumerate(body, start=2):
        if len(row) != len(header):
            raise UserError(f"--input={path} line {number} has {len(row)} cells where the header has "
                            f"{len(header)}; fix that line")
    return {name: _typed([row[k] for row in body]) for k, name in enumerate(header)}


def _typed(cells: list[str]) -> np.ndarray:
    """The narrowest of int64, float64 (empty cells NaN) and string that holds every cell."""
    try:
        return np.array([int(cell) for cell in cells], np.int64)
    except ValueError:
        pass
    try:
        return np.array([float(cell) if cell.strip() else np.nan for cell in cells], np.float64)
    except ValueError:
        return np.array(cells, object)


def _read_parquet(path: str) -> dict[str, np.ndarray]:
    try:
        import pyarrow.parquet as parquet
        import pyarrow.types as types
    except ImportError:
        raise UserError(f"--input={path}: reading Parquet needs pyarrow, which is not installed; pip install "
                        f"pyarrow, or give the table as CSV") from None
    try:
        table = parquet.read_table(path)
    except Exception as e:  # pyarrow raises its own ArrowInvalid, OSError, ...
        raise UserError(f"--input={path} cannot be read as Parquet ({type(e).__name__}: {e})") from None
    _check_names(path, table.column_names)
    columns = {}
    for name, column in zip(table.column_names, table.columns):
        if types.is_nested(column.type):
            raise UserError(f"--input={path} column {name!r} is {column.type}, a nested type; store one value per "
                            f"cell (flatten it into columns)")
        values = column.to_numpy(zero_copy_only=False)
        columns[name] = values.astype(object) if values.dtype.kind in "OUS" else values
    return columns


def _check_names(path: str, names: list[str]) -> None:
    if not names:
        raise UserError(f"--input={path} has no columns")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated or any(not name for name in names):
        raise UserError(f"--input={path} has {'repeated' if repeated else 'empty'} column names "
                        f"{repeated or [n for n in names if not n]}; give every column its own name")


def cell_bytes(values: np.ndarray, row: int) -> bytes:
    """The bytes a record holds for `values[row]`: UTF-8 for a string, the value's raw bytes otherwise."""
    value = values[row]
    if values.dtype == object or values.dtype.kind in "US":
        return str(value).encode() if not isinstance(value, bytes) else value
    return np.ascontiguousarray(value).tobytes()


def feature_spec(values: np.ndarray) -> dict:
    """The manifest's description of a column: {"dtype": numpy dtype string or "string", "shape": per row}."""
    if values.dtype == object or values.dtype.kind in "US":
        return {"dtype": STRING, "shape": []}
    return {"dtype": values.dtype.str, "shape": list(values.shape[1:])}
