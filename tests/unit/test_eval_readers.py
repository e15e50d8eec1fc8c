"""Streaming CSV / Parquet readers of ``recserve eval`` (clients/eval_readers.py)."""

from __future__ import annotations

import gzip

import pytest

from clients.eval_readers import file_format, iter_chunks
from embedding_store.errors import InvalidArgumentError


def test_csv_chunks_keep_line_numbers_and_report_unreadable_records(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text(
        "a,b\n"  # line 1
        "1,x\n"  # 2
        "\n"  # 3: blank, skipped
        '2,"multi\nline"\n'  # 4-5: one record ending on line 5
        "3\n"  # 6: one field
        "4,y\n"  # 7
        "5,z,extra\n"  # 8: three fields
        "6,w\n"  # 9
    )
    chunks = list(iter_chunks([path], chunk_rows=2))
    rows = [r for c in chunks for r in c.rows]
    assert [r["a"] for r in rows] == ["1", "2", "4", "6"]
    assert rows[1]["b"] == "multi\nline"
    assert [p for c in chunks for p in c.positions] == [2, 5, 7, 9]
    assert chunks[0].where(1) == f"{path}:5"
    bad = [str(b) for c in chunks for b in c.bad]
    assert bad == [
        f"{path}:6: has 1 fields, the header has 2",
        f"{path}:8: has 3 fields, the header has 2",
    ]
    assert all(len(c.rows) <= 2 for c in chunks)


def test_gzip_and_tsv(tmp_path):
    gz = tmp_path / "rows.csv.gz"
    with gzip.open(gz, "wt") as handle:
        handle.write("a,b\n1,2\n3,4\n")
    tsv = tmp_path / "rows.tsv"
    tsv.write_text("a\tb\n1\t2\n")
    assert [r["b"] for c in iter_chunks([gz, tsv], 10) for r in c.rows] == ["2", "4", "2"]


def test_a_utf8_byte_order_mark_is_no_part_of_the_first_column_name(tmp_path):
    # Excel's "CSV UTF-8" starts with a BOM: it used to make the first name "\ufeffuser",
    # and the mapping's "user" column was then "missing".
    plain = tmp_path / "bom.csv"
    plain.write_bytes(b"\xef\xbb\xbfuser,clicked\n7,1\n")
    gz = tmp_path / "bom.csv.gz"
    with gzip.open(gz, "wb") as handle:
        handle.write(b"\xef\xbb\xbfuser\tclicked\n8,x\t0\n")
    gz = gz.rename(tmp_path / "bom.tsv.gz")
    rows = [r for c in iter_chunks([plain, gz], 10) for r in c.rows]
    assert rows == [{"user": "7", "clicked": "1"}, {"user": "8,x", "clicked": "0"}]


def test_parquet_chunks(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"a": list(range(5)), "tags": [[1, 2], [], [3], None, [4]]}), path)
    chunks = list(iter_chunks([path], chunk_rows=2))
    assert [len(c.rows) for c in chunks] == [2, 2, 1]
    assert [p for c in chunks for p in c.positions] == [1, 2, 3, 4, 5]
    assert chunks[1].rows[0] == {"a": 2, "tags": [3]}
    assert chunks[2].where(0) == f"{path}:row 5"


def test_errors_name_the_file(tmp_path):
    with pytest.raises(InvalidArgumentError, match="unknown data format"):
        file_format(tmp_path / "rows.json")
    with pytest.raises(InvalidArgumentError, match="no such data file"):
        list(iter_chunks([tmp_path / "missing.csv"], 10))
    duplicate = tmp_path / "dup.csv"
    duplicate.write_text("a,a\n1,2\n")
    with pytest.raises(InvalidArgumentError, match=r"dup\.csv:1: the header"):
        list(iter_chunks([duplicate], 10))
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet")
    pytest.importorskip("pyarrow")
    with pytest.raises(InvalidArgumentError, match=r"broken\.parquet"):
        list(iter_chunks([broken], 10))
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    assert list(iter_chunks([empty], 10)) == []
