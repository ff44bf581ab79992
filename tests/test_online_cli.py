"""``python -m pyro_convexvb online``: learning from a text file with a resumable state."""
import numpy as np
import pytest
import torch

from pyro_convexvb.cli import main, run_online
from pyro_convexvb.datasets import make_criteo_text
from pyro_convexvb.online import OnlineBayesLogistic, iter_criteo


@pytest.fixture(scope="module")
def criteo(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "c.txt"
    make_criteo_text(path, 300, seed=1, num_features=2 ** 12, vocab_sizes=[40] * 26)
    return path


def test_online_command_learns_the_file_and_writes_a_plain_state(criteo, tmp_path, capsys):
    state = tmp_path / "s.pt"
    assert main(["online", str(criteo), "--format", "criteo", "--num-features", "4096", "--chunk-size", "100",
                 "--state", str(state), "--no-progress"]) == 0
    assert "300 rows" in capsys.readouterr().out
    saved = torch.load(state)  # weights_only=True
    assert saved["file_rows"] == 300 and saved["format"] == "criteo"
    ref = OnlineBayesLogistic(4096)
    loss = sum(ref.partial_fit(X, y, classes=[0, 1], return_log_loss=True).sum()
               for X, y in iter_criteo(criteo, chunk_size=100, num_features=4096))
    m = OnlineBayesLogistic.from_state_dict(saved["estimator"])
    np.testing.assert_array_equal(m.coef_, ref.coef_)
    assert m.cumulative_log_loss_ == pytest.approx(loss, rel=1e-12)
    assert main(["online", str(criteo), "--format", "svmlight", "--state", str(state), "--no-progress"]) == 2


def test_interrupted_run_resumes_where_it_stopped(criteo, tmp_path, monkeypatch):
    state = tmp_path / "s.pt"
    calls = {"n": 0}
    real = OnlineBayesLogistic.partial_fit

    def flaky(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(OnlineBayesLogistic, "partial_fit", flaky)
    res = run_online(criteo, "criteo", state_path=state, num_features=4096, chunk_size=100, progress=False,
                     save_every=1e9)
    assert res["interrupted"] and res["rows"] == 200 and torch.load(state)["file_rows"] == 200
    monkeypatch.setattr(OnlineBayesLogistic, "partial_fit", real)
    res = run_online(criteo, "criteo", state_path=state, resume=True, chunk_size=100, progress=False)
    assert res["rows"] == 100 and res["total_rows"] == 300 and not res["interrupted"]
    whole = run_online(criteo, "criteo", state_path=tmp_path / "w.pt", num_features=4096, chunk_size=100,
                       progress=False)
    a = torch.load(state)["estimator"]
    b = torch.load(tmp_path / "w.pt")["estimator"]
    assert torch.equal(a["mu"], b["mu"]) and torch.equal(a["s2"], b["s2"])
    assert whole["total_rows"] == 300


def test_online_command_reads_csv_and_svmlight(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("y,n,c\n1,3,a\n0,,b\n1,7,a\n")
    res = run_online(p, "csv", state_path=tmp_path / "c.pt", num_features=64, integer_columns=(1,),
                     categorical_columns=(2,), header=True, prior_var=1.0, progress=False)
    assert res["rows"] == 3
    s = tmp_path / "t.svm"
    s.write_text("1 1:1 3:0.5\n-1 2:1\n")
    res = run_online(s, "svmlight", state_path=tmp_path / "s.pt", num_features=3, progress=False)
    assert res["rows"] == 2
    with pytest.raises(ValueError, match="--num-features"):
        run_online(s, "svmlight", state_path=tmp_path / "s2.pt", progress=False)


def test_resume_keeps_the_states_reading_settings_and_refuses_others(criteo, tmp_path, capsys):
    """The hash seed, csv columns, feature count and prior are the state's: a resumed run that gives another value
    is refused (they were silently ignored, or the new file hashed with another seed into the old model's buckets);
    options of another format are refused."""
    state = str(tmp_path / "s.pt")
    base = ["online", str(criteo), "--format", "criteo", "--state", state, "--no-progress"]
    assert main(base + ["--num-features", "4096", "--hash-seed", "7", "--prior-var", "0.1"]) == 0
    assert torch.load(state)["reading"] == {"hash_seed": 7}
    capsys.readouterr()
    for extra, name in ((["--hash-seed", "8"], "--hash-seed 8"), (["--num-features", "123"], "--num-features 123"),
                        (["--prior-var", "5"], "--prior-var 5.0")):
        assert main(base + ["--resume"] + extra) == 2
        assert f"error: --resume: {name} differs from the state's" in capsys.readouterr().err
    assert main(base + ["--resume", "--hash-seed", "7"]) == 0  # the state's own value, or none, is fine
    assert main(base + ["--resume", "--zero-based"]) == 2
    assert "--zero-based: does not apply to --format criteo" in capsys.readouterr().err


def test_bad_state_paths_and_option_values_fail_before_learning(criteo, tmp_path, capsys):
    base = ["online", str(criteo), "--format", "criteo", "--no-progress"]
    assert main(base + ["--state", str(tmp_path / "no" / "s.pt")]) == 2
    assert "--state: no folder" in capsys.readouterr().err
    assert main(base + ["--state", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing learned, no stray temporary file
    for bad in (["--num-features", "0"], ["--save-every", "nan"], ["--save-every", "-1"], ["--chunk-size", "0"],
                ["--prior-var", "-1"], ["--prior-var", "nan"], ["--prior-var", "inf"], ["--prior-var", "abc"]):
        with pytest.raises(SystemExit) as e:
            main(base + bad)
        assert e.value.code == 2 and bad[0] in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["online", str(criteo), "--format", "csv", "--integer-columns", "1,a"])
    assert "--integer-columns: expected comma-separated column numbers" in capsys.readouterr().err
    gz = tmp_path / "bad.gz"
    gz.write_bytes(b"not gzip")
    assert main(["online", str(gz), "--format", "criteo", "--state", str(tmp_path / "g.pt"), "--no-progress"]) == 2
    assert "error: BadGzipFile" in capsys.readouterr().err


def test_label_coding_is_the_streams_not_the_first_chunks(tmp_path):
    """{-1, +1} labels whose first chunk is all +1, and LIBSVM's {1, 2}: the estimator infers the coding (the
    command fixed it from the first chunk as {0, 1} or {-1, +1}, then refused the file)."""
    rows = ["1 1:1"] * 10 + ["-1 2:1", "1 1:0.5"] * 5
    p = tmp_path / "pm.svm"
    p.write_text("\n".join(rows) + "\n")
    res = run_online(p, "svmlight", state_path=tmp_path / "a.pt", num_features=3, chunk_size=10, progress=False)
    assert res["total_rows"] == 20
    q = tmp_path / "12.svm"  # (a first chunk of label 1 alone would read as {0, 1}: this one has both)
    q.write_text("\n".join(r.replace("-1 ", "2 ") for r in rows[10:] + rows[:10]) + "\n")
    res = run_online(q, "svmlight", state_path=tmp_path / "b.pt", num_features=3, chunk_size=10, progress=False)
    m = OnlineBayesLogistic.from_state_dict(torch.load(tmp_path / "b.pt")["estimator"])
    assert res["total_rows"] == 20 and m.classes_.tolist() == [1, 2]


def test_resume_on_a_file_read_to_the_end_says_so(criteo, tmp_path, capsys):
    """A resumed run on the file its state has read to the end learns nothing: it says so, without a 'nan' log
    loss; ``--help`` describes when the state is written."""
    state = str(tmp_path / "s.pt")
    base = ["online", str(criteo), "--format", "criteo", "--state", state, "--no-progress", "--num-features", "4096"]
    assert main(base) == 0
    first = capsys.readouterr().out
    total = int(first.split(" rows learned in all")[0].split("; ")[-1])
    assert main(base[:-2] + ["--resume"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"0 new rows: the state had already learned every row of {criteo}; {total} rows learned")
    assert "nan" not in out
    with pytest.raises(SystemExit):
        main(["online", "--help"])
    assert "every --save-every seconds" in " ".join(capsys.readouterr().out.split())


def test_resume_refuses_a_file_shorter_than_its_state(criteo, tmp_path, capsys):
    """A state that learned 300 rows of a path now holding 100 rows (the file was replaced) refuses, and stays."""
    path = tmp_path / "c.txt"
    path.write_bytes(criteo.read_bytes())
    state = tmp_path / "s.pt"
    run_online(path, "criteo", state_path=state, num_features=4096, chunk_size=100, progress=False)
    before = torch.load(state)
    path.write_bytes(b"".join(criteo.read_bytes().splitlines(keepends=True)[:100]))
    with pytest.raises(ValueError, match="learned 300 rows of .* the file has only 100"):
        run_online(path, "criteo", state_path=state, resume=True, chunk_size=100, progress=False)
    after = torch.load(state)
    assert after["file_rows"] == 300 and torch.equal(after["estimator"]["mu"], before["estimator"]["mu"])
    assert main(["online", str(path), "--format", "criteo", "--state", str(state), "--resume", "--no-progress"]) == 2
    assert "the file has only 100" in capsys.readouterr().err


def test_interrupt_while_a_resume_skips_keeps_the_states_row_count(criteo, tmp_path, monkeypatch):
    """Ctrl-C while a resume is still passing the rows its state learned writes the state's row count back, not the
    rows passed so far (a later resume would learn rows 100-199 twice)."""
    state = tmp_path / "s.pt"
    path = tmp_path / "c.txt"
    lines = criteo.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:200]))
    run_online(path, "criteo", state_path=state, num_features=4096, chunk_size=100, progress=False)
    path.write_bytes(b"".join(lines))  # 100 rows appended
    import pyro_convexvb.online as online

    real = online.iter_criteo

    def interrupted_after_one_chunk(*a, **k):
        it = real(*a, **k)
        yield next(it)
        raise KeyboardInterrupt

    monkeypatch.setattr(online, "iter_criteo", interrupted_after_one_chunk)
    res = run_online(path, "criteo", state_path=state, resume=True, chunk_size=100, progress=False)
    assert res["interrupted"] and res["rows"] == 0 and torch.load(state)["file_rows"] == 200
    monkeypatch.setattr(online, "iter_criteo", real)
    res = run_online(path, "criteo", state_path=state, resume=True, chunk_size=100, progress=False)
    assert res["rows"] == 100 and res["total_rows"] == 300
    whole = torch.load(state)["estimator"]
    run_online(path, "criteo", state_path=tmp_path / "w.pt", num_features=4096, chunk_size=100, progress=False)
    assert torch.equal(whole["mu"], torch.load(tmp_path / "w.pt")["estimator"]["mu"])


def test_libsvm_labels_sorted_by_class_need_classes_and_bad_rows_name_the_file(tmp_path, capsys):
    """A LIBSVM file sorted by class (first chunk all 1, later 2s): the docs said the coding {1, 2} is inferred from
    the stream; it cannot be (1 was learned as the positive label), so ``--classes 1,2`` gives it, and without it
    the error names the file and the chunk's rows. A value that overflows float64 ended in a traceback
    (FloatingPointError); now exit 2 naming the file. A fresh run on an empty file said the state had learned
    every row, writing none."""
    rows = ["1 1:1"] * 10 + ["2 2:1", "2 1:0.5"] * 5
    p = tmp_path / "sorted.svm"
    p.write_text("\n".join(rows) + "\n")
    args = ["online", str(p), "--format", "svmlight", "--num-features", "3", "--chunk-size", "10", "--no-progress"]
    assert main(args + ["--state", str(tmp_path / "a.pt")]) == 2
    err = capsys.readouterr().err
    assert f"{p}: the chunk of data rows 11 to 20" in err and "not among the classes" in err
    assert main(args + ["--state", str(tmp_path / "b.pt"), "--classes", "2,1"]) == 0
    m = OnlineBayesLogistic.from_state_dict(torch.load(tmp_path / "b.pt")["estimator"])
    ref = OnlineBayesLogistic(3, prior_var="auto")
    y = np.array([float(r.split()[0]) for r in rows])
    X = np.zeros((20, 3))
    for i, r in enumerate(rows):
        j, v = r.split()[1].split(":")
        X[i, int(j) - 1] = float(v)  # one-based indices
    for k in (0, 10):
        ref.partial_fit(X[k:k + 10], y[k:k + 10], classes=[1.0, 2.0])
    assert m.classes_.tolist() == [1, 2] and m.n_seen_ == 20
    np.testing.assert_allclose(m.coef_, ref.coef_, rtol=1e-12)
    big = tmp_path / "big.svm"
    big.write_text("\n".join(["1 1:1", "0 2:1"] * 3 + ["1 2:1e200"]) + "\n")
    capsys.readouterr()
    assert main(["online", str(big), "--format", "svmlight", "--num-features", "3", "--no-progress", "--state",
                 str(tmp_path / "c.pt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {big}: the chunk of data rows 1 to 7") and "1e+200" in err
    empty = tmp_path / "empty.svm"
    empty.write_text("")
    assert main(["online", str(empty), "--format", "svmlight", "--num-features", "3", "--no-progress", "--state",
                 str(tmp_path / "d.pt")]) == 0
    assert "holds no data rows; no state written" in capsys.readouterr().out
    assert not (tmp_path / "d.pt").exists()


def _same_state(a, b):
    """Two saved estimator states hold the same values, bit for bit."""
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k], k


@pytest.mark.parametrize("where", ["before", "inside", "after"])
def test_an_interrupt_anywhere_around_a_chunk_resumes_to_the_uninterrupted_state(criteo, tmp_path, monkeypatch,
                                                                                 where):
    """Ctrl-C before the second chunk, inside it (after the kernel ran: the chunk is undone) or just after
    partial_fit returned (before the command counted the rows): the state's row count is its model's, and the
    resumed state equals the uninterrupted run's bit for bit. The row count was advanced after partial_fit
    returned, so an interrupt at that point saved a model of 200 rows recorded as 100, and a resume learned rows
    101-200 twice."""
    state = tmp_path / "s.pt"
    calls = {"n": 0}
    real_fit, real_run = OnlineBayesLogistic.partial_fit, OnlineBayesLogistic._run

    def fit(self, *a, **k):
        calls["n"] += 1
        if where == "before" and calls["n"] == 2:
            raise KeyboardInterrupt
        out = real_fit(self, *a, **k)
        if where == "after" and calls["n"] == 2:
            raise KeyboardInterrupt
        return out

    def run(self, *a, **k):
        out = real_run(self, *a, **k)
        if where == "inside" and calls["n"] == 2:
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(OnlineBayesLogistic, "partial_fit", fit)
    monkeypatch.setattr(OnlineBayesLogistic, "_run", run)
    res = run_online(criteo, "criteo", state_path=state, num_features=4096, chunk_size=100, progress=False)
    learned = 200 if where == "after" else 100
    saved = torch.load(state)
    assert res["interrupted"] and res["rows"] == learned and res["total_rows"] == learned
    assert saved["file_rows"] == saved["estimator"]["n_seen"] == learned and saved["n_seen_before_file"] == 0
    monkeypatch.setattr(OnlineBayesLogistic, "partial_fit", real_fit)
    monkeypatch.setattr(OnlineBayesLogistic, "_run", real_run)
    res = run_online(criteo, "criteo", state_path=state, resume=True, chunk_size=100, progress=False)
    assert res["rows"] == 300 - learned and res["total_rows"] == 300
    run_online(criteo, "criteo", state_path=tmp_path / "w.pt", num_features=4096, chunk_size=100, progress=False)
    _same_state(torch.load(state)["estimator"], torch.load(tmp_path / "w.pt")["estimator"])


def test_resume_refuses_a_state_whose_model_disagrees_with_its_row_count(criteo, tmp_path, capsys):
    """A state whose estimator has learned 300 rows but records 200 of its file (what an interrupt just after a
    chunk wrote before) is refused: a resume would learn rows 201-300 twice. A state without
    ``n_seen_before_file`` (written before it was recorded) may have learned other files first: it is refused
    only when it records more rows of its file than its model learned."""
    state = tmp_path / "s.pt"
    run_online(criteo, "criteo", state_path=state, num_features=4096, chunk_size=100, progress=False)
    good = torch.load(state)
    assert (good["file_rows"], good["n_seen_before_file"], good["estimator"]["n_seen"]) == (300, 0, 300)
    torch.save({**good, "file_rows": 200}, state)
    with pytest.raises(ValueError, match=r"inconsistent: its model has learned 300 rows, but the state records 0 "
                                         r"rows before its file and 200 rows of '.*c\.txt'; resuming would skip"):
        run_online(criteo, "criteo", state_path=state, resume=True, chunk_size=100, progress=False)
    assert main(["online", str(criteo), "--format", "criteo", "--state", str(state), "--resume",
                 "--no-progress"]) == 2
    assert "error: --resume: " in capsys.readouterr().err
    legacy = {k: v for k, v in good.items() if k != "n_seen_before_file"}
    torch.save({**legacy, "file_rows": 400}, state)
    with pytest.raises(ValueError, match="its model has learned 300 rows, but the state records 400 rows of"):
        run_online(criteo, "criteo", state_path=state, resume=True, chunk_size=100, progress=False)
    torch.save(legacy, state)  # 300 of 300: read to the end
    assert run_online(criteo, "criteo", state_path=state, resume=True, chunk_size=100, progress=False)["rows"] == 0


def test_interrupt_before_the_first_chunk_writes_no_state_and_says_so(criteo, tmp_path, monkeypatch, capsys):
    """Ctrl-C before a new run learned its first chunk: the command said 'state: PATH ... continue with --resume'
    (and a 'nan' log loss) but wrote no state, so the suggested resume failed. A resumed run interrupted before a
    new row keeps its state as it was, and says so."""
    state = tmp_path / "s.pt"

    def interrupted(self, *a, **k):
        raise KeyboardInterrupt

    real = OnlineBayesLogistic.partial_fit
    monkeypatch.setattr(OnlineBayesLogistic, "partial_fit", interrupted)
    args = ["online", str(criteo), "--format", "criteo", "--num-features", "4096", "--state", str(state),
            "--no-progress"]
    assert main(args) == 130
    out = capsys.readouterr().out
    assert out == ("interrupted before the first chunk was learned: nothing learned, no state written; run again "
                   "without --resume\n")
    assert not state.exists() and list(tmp_path.iterdir()) == []
    res = run_online(criteo, "criteo", state_path=state, num_features=4096, progress=False)
    assert res["interrupted"] and res["rows"] == 0 and res["state_path"] is None
    monkeypatch.setattr(OnlineBayesLogistic, "partial_fit", real)
    assert main(args + ["--chunk-size", "100", "--save-every", "1e9"]) == 0
    before = torch.load(state)
    path = tmp_path / "more.txt"  # another file: the state's record of its file stays as it was
    path.write_bytes(criteo.read_bytes())
    capsys.readouterr()
    monkeypatch.setattr(OnlineBayesLogistic, "partial_fit", interrupted)
    assert main(["online", str(path), "--format", "criteo", "--state", str(state), "--resume", "--no-progress"]) == 130
    out = capsys.readouterr().out
    assert out.startswith(f"interrupted before a new row was learned: the state is as it was, 300 rows learned in "
                          f"all; state: {state}\n") and "continue with --resume" in out and "nan" not in out
    after = torch.load(state)
    assert after["file"] == before["file"] and after["file_rows"] == 300


def test_a_truncated_gz_file_is_a_clear_error(tmp_path, capsys):
    """A .gz file cut short: exit 2 naming the file (it was gzip's bare EOFError, no file named)."""
    import gzip

    blob = gzip.compress(b"1 1:1 2:0.5\n" * 5000)
    path = tmp_path / "t.svm.gz"
    path.write_bytes(blob[: len(blob) // 2])
    assert main(["online", str(path), "--format", "svmlight", "--num-features", "3", "--no-progress", "--state",
                 str(tmp_path / "s.pt")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {path}: the .gz file is truncated or corrupt: ")
