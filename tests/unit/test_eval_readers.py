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


# --------------------------------------------------------------------------- edge cases found
# unchecked by mutation testing
def test_chunk_size_must_be_positive(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("a\n1\n")
    with pytest.raises(InvalidArgumentError, match="chunk size must be > 0, got 0"):
        list(iter_chunks([path], 0))


def test_a_directory_is_named_as_such(tmp_path):
    folder = tmp_path / "data.csv"
    folder.mkdir()
    with pytest.raises(InvalidArgumentError, match=r"data\.csv: is a directory, expected a data"):
        list(iter_chunks([folder], 10))


def test_header_names_are_stripped_and_must_not_be_blank(tmp_path):
    spaced = tmp_path / "spaced.csv"
    spaced.write_text(" a , b \n1,2\n")
    (chunk,) = iter_chunks([spaced], 10)
    assert chunk.columns == ("a", "b") and chunk.rows == [{"a": "1", "b": "2"}]
    blank = tmp_path / "blank.csv"
    blank.write_text("a, ,b\n1,2,3\n")
    with pytest.raises(
        InvalidArgumentError, match=r"blank\.csv:1: the header must name every column once"
    ):
        list(iter_chunks([blank], 10))


def test_lines_of_spaces_are_blank_lines_not_bad_records(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("a,b\n1,x\n   \n\n2,y\n")
    (chunk,) = iter_chunks([path], 10)
    assert [r["a"] for r in chunk.rows] == ["1", "2"] and chunk.positions == [2, 5]
    assert chunk.bad == []


def test_long_fields_are_read_whatever_the_csv_modules_limit_was(tmp_path):
    """ID lists longer than the csv module's default 128 KiB field limit are legitimate."""
    import csv

    path = tmp_path / "long.csv"
    ids = " ".join(["123456789"] * 20_000)  # 200 000 characters
    path.write_text(f"user,ids\n1,{ids}\n")
    previous = csv.field_size_limit(131_072)  # the default, whatever an earlier test set
    try:
        (chunk,) = iter_chunks([path], 10)
    finally:
        csv.field_size_limit(previous)
    assert chunk.rows[0]["ids"] == ids


def test_a_record_the_csv_module_refuses_is_a_bad_row_even_alone_in_its_chunk(
    tmp_path, monkeypatch
):
    """A csv.Error is reported as file:line with the module's reason; a chunk holding only
    bad records is still yielded (its bad rows must reach the report)."""
    import csv

    path = tmp_path / "rows.csv"
    path.write_text("a\n1\n" + "x" * 50 + "\n")
    set_limit = csv.field_size_limit
    previous = set_limit(10)
    monkeypatch.setattr(csv, "field_size_limit", lambda limit: None)  # the reader keeps 10
    try:
        chunks = list(iter_chunks([path], 1))
    finally:
        set_limit(previous)
    assert [c.rows for c in chunks] == [[{"a": "1"}], []]
    (bad,) = chunks[1].bad
    assert str(bad) == f"{path}:3: bad CSV: field larger than field limit (10)"
    assert bad.position == 3


def test_unreadable_bytes_name_the_file(tmp_path):
    latin = tmp_path / "latin.csv"
    latin.write_bytes(b"a\n\xff\n")
    with pytest.raises(
        InvalidArgumentError, match=r"latin\.csv: not UTF-8 text: invalid start byte"
    ):
        list(iter_chunks([latin], 10))
    truncated = tmp_path / "cut.csv.gz"
    truncated.write_bytes(gzip.compress(b"a,b\n" + b"1,2\n" * 1000)[:40])
    with pytest.raises(InvalidArgumentError, match=r"cut\.csv\.gz: cannot read: "):
        list(iter_chunks([truncated], 10))
