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
