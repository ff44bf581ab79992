"""Whole-file readers of pyro_convexvb.datasets on the reading core: the defects an audit found, fixed."""
import gzip

import numpy as np
import pytest
import torch

from pyro_convexvb import datasets as D

SVM = b"1 1:0.5 3:-2 # note\x0cwith a form feed 2:7\n# a comment line\n\n-1 2:1.25\r\n1 3:3 1:1\n"
DENSE = np.array([[0.5, 0, -2], [0, 1.25, 0], [1, 0, 3]])


def _write(tmp_path, name, data):
    p = tmp_path / name
    if name.endswith(".gz"):
        with gzip.open(p, "wb") as f:
            f.write(data)
    else:
        p.write_bytes(data)
    return p


@pytest.mark.parametrize("name", ["t.svm", "t.svm.gz"])
@pytest.mark.parametrize("backend", ["sklearn", "python"])
def test_svmlight_form_feed_gz_crlf_and_unsorted(tmp_path, name, backend):
    p = _write(tmp_path, name, SVM)
    X, y = D.load_svmlight(p, backend=backend)
    np.testing.assert_array_equal(X.to_dense().numpy(), DENSE)
    assert y.tolist() == [1.0, -1.0, 1.0]
    for P in (1, 2, 3, 5):
        parts = [D.load_svmlight(p, n_features=3, zero_based=False, shard=(r, P), backend=backend)
                 for r in range(P)]
        assert sum(q[0].shape[0] for q in parts) == 3  # the form feed invents no row
        dense = torch.cat([q[0].to_dense() for q in parts if q[0].shape[0]])
        np.testing.assert_array_equal(dense.numpy(), DENSE)


@pytest.mark.parametrize("backend", ["sklearn", "python"])
def test_svmlight_duplicate_and_bad_indices_raise_with_the_line(tmp_path, backend):
    p = _write(tmp_path, "d.svm", b"1 1:1\n# c\n1 3:1 3:2\n")
    with pytest.raises(ValueError, match=r"d.svm, line 3: feature index 3 appears twice"):
        D.load_svmlight(p, backend=backend)
    with pytest.raises(ValueError, match=r"line 3: feature index 3 appears twice"):
        D.load_svmlight(p, n_features=4, zero_based=False, shard=(1, 2), backend=backend)
    p = _write(tmp_path, "n.svm", b"1 1:1\n1 -3:0.5\n")
    with pytest.raises(ValueError, match=r"n.svm, line 2: negative feature index -3"):
        D.load_svmlight(p, backend=backend)
    p = _write(tmp_path, "z.svm", b"1 1:1\n\n1 0:0.5\n")
    with pytest.raises(ValueError, match=r"z.svm, line 3: feature index 0 in a file read as one-based"):
        D.load_svmlight(p, zero_based=False, backend=backend)
    X, _ = D.load_svmlight(p, backend=backend)  # "auto": an index 0 means zero-based
    assert X.shape == (2, 2)


def test_read_byte_range_of_gzip_equals_the_plain_file(tmp_path):
    data = b"".join(b"%d 1:%d\n" % (i % 2, i) for i in range(100))
    plain, gz = _write(tmp_path, "a.svm", data), _write(tmp_path, "a.svm.gz", data)
    for P in (1, 2, 7):
        assert [D.read_byte_range(gz, (r, P)) for r in range(P)] == [D.read_byte_range(plain, (r, P))
                                                                      for r in range(P)]


@pytest.mark.parametrize("name", ["t.csv", "t.csv.gz"])
def test_csv_form_feed_gz_crlf_and_errors(tmp_path, name):
    p = _write(tmp_path, name, b"y,a,b\r\n1,0.5,2\r\n\r\n0,1\x0c,3\n1,inf,4")
    X, y = D.load_csv(p, header=True)
    np.testing.assert_array_equal(X.numpy(), [[0.5, 2], [1, 3], [np.inf, 4]])  # float(" 1\f") == 1
    assert y.tolist() == [1.0, 0.0, 1.0]
    parts = [D.load_csv(p, header=True, shard=(r, 3)) for r in range(3)]
    np.testing.assert_array_equal(torch.cat([q[0] for q in parts if q[0].numel()]).numpy(), X.numpy())
    bad = _write(tmp_path, "b" + name, b"1,2\n0,x\n")
    with pytest.raises(ValueError, match=r"line 2: a non-numeric field"):
        D.load_csv(bad)
    bad = _write(tmp_path, "w" + name, b"1,2\n0,1,5\n")
    with pytest.raises(ValueError, match=r"line 2: 3 fields, the lines before have 2"):
        D.load_csv(bad)


def test_csv_label_column_outside_the_table_header_only_and_blank_lines_before_the_header(tmp_path):
    """A label column outside the table is refused (it wrapped round: column 3 of a 3-column file was column 0);
    a header-only file keeps the header's feature count; blank lines before the header are skipped (the first blank
    line was taken as the header)."""
    p = _write(tmp_path, "t.csv", b"1,0.5,2\n0,1,3\n")
    for col in (3, 5, -4):
        with pytest.raises(ValueError, match=rf"label_column={col}: .* has 3 columns"):
            D.load_csv(p, label_column=col)
    X, y = D.load_csv(p, label_column=-1)
    assert y.tolist() == [2.0, 3.0] and X.tolist() == [[1.0, 0.5], [0.0, 1.0]]
    X, y = D.load_csv(_write(tmp_path, "h.csv", b"y,a,b\n"), header=True)
    assert tuple(X.shape) == (0, 2) and tuple(y.shape) == (0,)
    X, y = D.load_csv(_write(tmp_path, "bh.csv", b"\n\ny,a,b\n1,2,3\n"), header=True)
    assert X.tolist() == [[2.0, 3.0]] and y.tolist() == [1.0]
    with pytest.raises(ValueError, match=r"line 4: 2 fields, the header has 3"):
        D.load_csv(_write(tmp_path, "bw.csv", b"\n\ny,a,b\n1,2\n"), header=True)


def test_make_criteo_text_labels_follow_its_model_in_the_readers_feature_space(tmp_path):
    from pyro_convexvb.online import iter_criteo

    small = [50] * 26
    info = D.make_criteo_text(tmp_path / "c.txt.gz", 3000, seed=3, num_features=2 ** 10, vw_path=tmp_path / "c.vw",
                              vocab_sizes=small)
    again = D.make_criteo_text(tmp_path / "d.txt", 3000, seed=3, num_features=2 ** 10, vocab_sizes=small)
    with gzip.open(tmp_path / "c.txt.gz", "rb") as f:
        assert f.read() == (tmp_path / "d.txt").read_bytes()  # a function of the seed
    assert info.comparator_log_loss == again.comparator_log_loss
    total, rows = 0.0, 0
    for X, y in iter_criteo(tmp_path / "c.txt.gz", chunk_size=700, num_features=2 ** 10):
        s = X @ info.w_true  # collisions in 2^10 buckets are summed by both
        total += float(np.logaddexp(0.0, np.where(y > 0, -s, s)).sum())
        rows += X.shape[0]
    assert rows == 3000
    assert total == pytest.approx(info.comparator_log_loss, rel=1e-10)
    assert 0.2 < info.positive_rate < 0.3
    vw = (tmp_path / "c.vw").read_text().splitlines()
    assert len(vw) == 3000 and all(ln.startswith(("1 |f", "-1 |f")) for ln in vw)
    with gzip.open(tmp_path / "c.txt.gz", "rt") as f:
        first = f.readline().rstrip("\n").split("\t")
    toks = vw[0].split()[2:]
    assert len(toks) == sum(v != "" for v in first[1:])
    assert (vw[0].startswith("1 ")) == (first[0] == "1")


def test_load_csv_shards_check_their_width_against_the_files_first_line(tmp_path):
    """A ragged file raised when read whole but each shard returned its own width (ranks with matrices of
    different widths, no error); a later shard now takes the width of the file's first line (or header)."""
    from pyro_convexvb.datasets import load_csv

    p = tmp_path / "ragged.csv"
    p.write_text("".join(f"{i % 2},10,20\n" for i in range(30)) + "".join(f"{i % 2},10000\n" for i in range(30)))
    with pytest.raises(ValueError, match=r"ragged.csv, line 31: 2 fields, the lines before have 3"):
        load_csv(p, shard=(1, 2))
    h = tmp_path / "ragged_h.csv"
    h.write_text("y,a,b\n" + "".join(f"{i % 2},{i}\n" for i in range(60)))
    with pytest.raises(ValueError, match=r"ragged_h.csv, line 33: 2 fields, the header has 3"):
        load_csv(h, header=True, shard=(1, 2))
    X, y = load_csv(p, shard=(0, 2))  # its own lines are whole: the rank reading line 31 raises
    assert X.shape == (30, 2)


def test_read_svmlight_reads_as_the_reading_core_does(tmp_path):
    """``pcv.io.read_svmlight`` opened the file as text (a lone carriage return ended a line, where the reading
    core keeps it inside a comment) and could not read ``.gz`` (a bare UnicodeDecodeError)."""
    from pyro_convexvb.io import read_svmlight

    p = tmp_path / "a.svm"
    p.write_bytes(b"1 1:1 # a\rb\n-1 2:3\r\n")
    indptr, indices, values, labels = read_svmlight(p)
    assert indptr.tolist() == [0, 1, 2] and indices.tolist() == [0, 1] and labels.tolist() == [1.0, -1.0]
    g = tmp_path / "a.svm.gz"
    with gzip.open(g, "wb") as f:
        f.write(b"1 1:1\n-1 2:3\n")
    assert read_svmlight(g)[1].tolist() == [0, 1]
