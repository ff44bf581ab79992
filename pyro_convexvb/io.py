"""Files: atomic, ``weights_only``-loadable persistence (:func:`save`, :func:`load`), and the LIBSVM reader.

* :func:`save` / :func:`load` (exported as ``pcv.save`` / ``pcv.load``): online learners, inference results,
  posteriors and fitted estimators as plain states (class name, version, tensors and plain Python types),
  written atomically by :func:`atomic_write` (docs/core.md, § Saving and loading).
* The LIBSVM / svmlight text format, shared by :mod:`pyro_convexvb.datasets` (whole files) and
  :mod:`pyro_convexvb.online.streams` (chunked streams). A line is ``label idx:value idx:value ...`` with an
  optional ``# comment``; ``qid:...`` tokens are ignored. This part needs only NumPy at import (the
  persistence helpers import torch and the library lazily), so both users import this module without
  importing each other.
"""
import gzip


__all__ = ["parse_svmlight_lines", "read_svmlight", "open_text", "save", "load", "atomic_write", "to_state",
           "from_state"]


def open_text(path):
    """Open a UTF-8 text file for reading, transparently decompressing a ``.gz`` file."""
    path = str(path)
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, "r", encoding="utf-8")


def parse_svmlight_lines(lines, path="<lines>", first_lineno=1):
    """Parse LIBSVM/svmlight lines (``label idx:value ...``; ``#`` comments, ``qid:`` ignored).

    The reference parser of the reading core (:func:`pyro_convexvb.online._textio.parse_svmlight_block`), for lines
    already in memory: a duplicated index in a row and a negative index raise, as in scikit-learn's
    ``load_svmlight_file`` and :func:`pyro_convexvb.datasets.load_svmlight`.

    :param lines: iterable of text (or bytes) lines.
    :param path: name used in error messages.
    :param int first_lineno: line number of the first line (for error messages).
    :returns: ``(indptr, indices, values, labels)`` numpy arrays of shapes ``(N + 1,)``,
        ``(nnz,)``, ``(nnz,)``, ``(N,)`` (CSR layout); ``indices`` as written in the file.
    :raises ValueError: a malformed line, naming the file and line number.

    Example::

        >>> indptr, indices, values, labels = parse_svmlight_lines(["1 3:0.5 7:2", "-1 qid:4 1:1 # c"])
        >>> indptr.tolist(), indices.tolist(), values.tolist(), labels.tolist()
        ([0, 2, 3], [3, 7, 1], [0.5, 2.0, 1.0], [1.0, -1.0])
    """
    from .online._textio import parse_svmlight_block

    return parse_svmlight_block(lines, path, first_lineno)


def check_zero_based(zero_based, allow_auto=True):
    """Refuse a ``zero_based`` other than ``True``, ``False`` (or ``"auto"``): any truthy string read as zero-based
    would shift every column."""
    import numpy as np

    auto = allow_auto and isinstance(zero_based, str) and zero_based == "auto"
    if isinstance(zero_based, (bool, np.bool_)) or auto:
        return
    raise ValueError(f"zero_based: expected True, False{' or auto' if allow_auto else ''}, got {zero_based!r}")


def read_svmlight(path, zero_based="auto"):
    """Read a whole LIBSVM/svmlight file with :func:`parse_svmlight_lines` (:func:`pyro_convexvb.datasets.load_svmlight`
    reads it faster, as a CSR tensor).

    :param path: file path (``.gz`` is decompressed); lines end at ``\n`` (``\r\n`` too), as in the reading core.
    :param zero_based: ``True``, ``False`` or ``"auto"`` (one-based unless an index 0 occurs, as
        in scikit-learn).
    :returns: ``(indptr, indices, values, labels)`` numpy arrays as in :func:`parse_svmlight_lines`,
        with ``indices`` zero-based.
    :raises ValueError: a malformed line, or an index 0 in a file read as one-based.
    """
    from .online._textio import open_binary

    check_zero_based(zero_based)
    with open_binary(path) as f:  # bytes lines: a lone \r is an ordinary character, not a line end
        indptr, indices, values, labels = parse_svmlight_lines(f, path)
    if zero_based is False or (zero_based == "auto" and (indices.size == 0 or indices.min() > 0)):
        indices -= 1
    if indices.size and indices.min() < 0:
        raise ValueError(f"{path}: feature index 0 in a file read as one-based (use zero_based=True)")
    return indptr, indices, values, labels


# =============================================================================================
# Atomic, weights_only-loadable persistence: pcv.save / pcv.load
# =============================================================================================
#: the ``format`` tag of a file written by :func:`save`
SAVE_FORMAT = "pyro_convexvb.save"
#: version of the file layout; :func:`load` refuses other versions
SAVE_FORMAT_VERSION = 1


def atomic_write(path, write):
    """Write a file so that a crash at any moment leaves either its old content or the new one.

    ``write(f)`` fills a temporary file in the same directory; it is flushed and ``fsync``-ed, renamed
    over ``path`` with :func:`os.replace` (atomic on POSIX and Windows), and the directory is ``fsync``-ed
    so the rename itself survives a power loss.  A process killed before the rename leaves ``path``
    untouched and a stray ``.<name>.*.tmp`` file next to it (never read; safe to delete).

    :param path: destination file path (``str`` or path-like).
    :param callable write: ``write(f)`` writes the content to the binary file object ``f``.

    Example::

        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "x.bin")
        >>> atomic_write(p, lambda f: f.write(b"hello"))
        >>> open(p, "rb").read()
        b'hello'
    """
    import os
    import tempfile

    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"path: the directory {directory!r} of {path!r} does not exist")
    if os.path.isdir(path):
        raise IsADirectoryError(f"path: {path!r} is a directory; give a file name")
    try:
        mode = os.stat(path).st_mode & 0o777
    except FileNotFoundError:
        mode = None
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if mode is None:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_directory(directory)


def _fsync_directory(directory):
    import os

    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows: directories cannot be opened
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save(obj, path):
    """Save an online learner, an inference result, a posterior or a fitted estimator to ``path``, atomically.

    The file is written by :func:`atomic_write` (temporary file in the same directory, ``fsync``,
    :func:`os.replace`, ``fsync`` of the directory): a ``kill -9`` or a power loss at any moment leaves
    either the previous file or the new one, never a truncated one.  The content is a *plain state*:
    tensors and Python ``dict``/``list``/``str``/numbers/``None`` only (NumPy arrays are stored as
    tensors), with the class name and a version for every object, so ``torch.load(path)`` with torch's
    default ``weights_only=True`` reads it without running any code from the file; :func:`load`
    rebuilds the object.

    What is stored (docs/core.md, § Saving and loading):

    * online learners (:mod:`pyro_convexvb.online`): their ``state_dict()``;
    * :class:`~pyro_convexvb.InferenceResult`: posterior, bound, history, convergence, optimality,
      hyperparameters, and the ``info`` entries that are plain data or model-sized arrays; ``lgm``, the
      Pyro model and its data are not stored (the ``dropped`` entry of ``info`` lists what was left out);
    * :class:`~pyro_convexvb.GaussianPosterior` and mixture posteriors: mean, covariance representation,
      layout (:meth:`~pyro_convexvb.GaussianPosterior.compact`: a matrix-free precision is stored dense
      up to ``MAX_COMPACT_DENSE`` (1000) coordinates, else only its marginal variances);
    * fitted :class:`~pyro_convexvb.BayesianLogisticRegression`, :class:`~pyro_convexvb.GLM` and
      :class:`~pyro_convexvb.BayesianLinearRegression` (with the default ``basis=None``): constructor
      parameters and the fitted attributes prediction needs; the file does not grow with the number of
      training rows.

    :param obj: the object to save.
    :param path: file path; its directory must exist.
    :raises TypeError: for an object (or a part of it, named in the message) without a plain state.

    Example::

        >>> import os, tempfile, torch, pyro_convexvb as pcv
        >>> q = pcv.GaussianPosterior(torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64))
        >>> p = os.path.join(tempfile.mkdtemp(), "q.pt")
        >>> pcv.save(q, p)
        >>> sorted(torch.load(p))  # weights_only=True
        ['format', 'format_version', 'library_version', 'object']
        >>> pcv.load(p).variance
        tensor([1., 1.], dtype=torch.float64)
    """
    import torch

    from . import __version__

    payload = {"format": SAVE_FORMAT, "format_version": SAVE_FORMAT_VERSION, "library_version": __version__,
               "object": to_state(obj)}
    atomic_write(path, lambda f: torch.save(payload, f))


def load(path, map_location=None):
    """Load an object written by :func:`save`.

    The file is read with ``torch.load(path, weights_only=True)`` (no code from the file runs), then
    the object is rebuilt from its plain state.

    :param path: file path.
    :param map_location: as in :func:`torch.load` (e.g. ``"cpu"`` for a file saved from CUDA tensors).
    :returns: the rebuilt object (an online learner, :class:`~pyro_convexvb.InferenceResult`, posterior or
        estimator).
    :raises ValueError: a file not written by :func:`save`, of another format version, naming an unknown class or
        class version, or whose object is malformed (a field missing, of the wrong type or shape).

    Example::

        >>> import os, tempfile, torch, pyro, pyro.distributions as dist
        >>> import pyro_convexvb as pcv
        >>> def model(X, y=None):
        ...     w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=X.dtype), 1.).to_event(1))
        ...     with pyro.plate("data", X.shape[0]):
        ...         pyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)
        >>> X = torch.randn(20, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        >>> res = pcv.fit(model, X, y=X.sum(1), engine="dual_vg", progress=False)
        >>> path = os.path.join(tempfile.mkdtemp(), "fit.pt")
        >>> pcv.save(res, path)
        >>> back = pcv.load(path)
        >>> torch.equal(back.posterior.loc, res.posterior.loc), back.log_evidence_bound == res.log_evidence_bound
        (True, True)
    """
    import torch

    import os

    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # empty, truncated or foreign bytes: torch's reader fails in many ways
        raise ValueError(f"{path}: not a readable file written by pyro_convexvb.save (it is empty, truncated or "
                         f"corrupt: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no detail'})") from None
    if not isinstance(payload, dict) or payload.get("format") != SAVE_FORMAT:
        raise ValueError(f"{path}: not a file written by pyro_convexvb.save (no format tag {SAVE_FORMAT!r})")
    if payload.get("format_version") != SAVE_FORMAT_VERSION:
        raise ValueError(f"{path}: file format version {payload.get('format_version')!r} (written by pyro_convexvb "
                         f"{payload.get('library_version')!r}); this version reads version {SAVE_FORMAT_VERSION}: "
                         "load it with the library version that wrote it")
    if "object" not in payload:
        raise ValueError(f"{path}: a pyro_convexvb.save file without its object (corrupt)")
    try:
        return from_state(payload["object"])
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    except (KeyError, AttributeError, TypeError, IndexError, RuntimeError) as e:  # a field missing or of a wrong type
        raise ValueError(f"{path}: a pyro_convexvb.save file whose object is malformed (corrupt or edited: "
                         f"{type(e).__name__}: {e})") from None


# ---------------------------------------------------------------------------------------------
# plain states
# ---------------------------------------------------------------------------------------------
_TAG = "__pcv__"  # key marking an encoded non-plain value (a dict with this key is never user data)


def _obj(cls_name, version, **fields):
    return {_TAG: "object", "class": cls_name, "version": version, "fields": fields}


def to_state(obj):
    """The plain state of ``obj`` (what :func:`save` writes): tensors and plain Python types only.

    :raises TypeError: naming the first part of ``obj`` that has no plain form.
    """
    return _encode(obj, "obj")


def from_state(state):
    """Rebuild an object from :func:`to_state` output.

    :raises ValueError: an unknown class, or a class version this library does not read.
    """
    return _decode(state, "state")


def _encode(x, where):
    import numpy as np
    import torch

    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, torch.Tensor):
        if isinstance(x, torch.nn.Parameter):
            return {_TAG: "parameter", "data": x.detach().clone()}
        return x.detach()
    if isinstance(x, np.generic):
        return _encode(x.item(), where)
    if isinstance(x, np.ndarray):
        if x.dtype.kind in "biufc":
            return {_TAG: "ndarray", "data": torch.from_numpy(np.ascontiguousarray(x).copy())}
        return {_TAG: "ndarray", "dtype": "object" if x.dtype.kind == "O" else x.dtype.str, "shape": list(x.shape),
                "items": [_encode(v, f"{where}[{i}]") for i, v in enumerate(x.reshape(-1).tolist())]}
    if isinstance(x, torch.dtype):
        return {_TAG: "dtype", "name": str(x).replace("torch.", "")}
    if isinstance(x, slice):
        return {_TAG: "slice", "args": [x.start, x.stop, x.step]}
    if type(x) is np.random.RandomState:  # an estimator's random_state: its generator state, restored on load
        return {_TAG: "random_state", "state": _encode(x.get_state(), where)}
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return {_TAG: "tuple", "items": [_encode(v, f"{where}[{i}]") for i, v in enumerate(x)]}
    if isinstance(x, list):
        return [_encode(v, f"{where}[{i}]") for i, v in enumerate(x)]
    if type(x) is dict:
        if all(isinstance(k, str) for k in x) and _TAG not in x:
            return {k: _encode(v, f"{where}[{k!r}]") for k, v in x.items()}
        return {_TAG: "dict", "keys": [_encode(k, f"{where} key") for k in x],
                "values": [_encode(v, f"{where}[{k!r}]") for k, v in x.items()]}
    for cls, (name, enc, _, _) in _codecs().items():
        if type(x) is cls:
            return enc(x, where)
    from .online._base import OnlineEstimatorBase

    if isinstance(x, OnlineEstimatorBase):
        return _obj("online." + type(x).__name__, 1, state=_encode(x.state_dict(), f"{where}.state_dict()"))
    from sklearn.base import BaseEstimator

    if isinstance(x, BaseEstimator):
        return _encode_estimator(x, where)
    raise TypeError(f"pyro_convexvb.save: {where} is a {type(x).__module__}.{type(x).__qualname__}, which has no "
                    "plain (weights_only) state; save its tensors and plain data yourself, or pickle it "
                    "(pickles run code when loaded: trusted files only)")


def _decode(x, where):
    import numpy as np
    import torch

    if isinstance(x, list):
        return [_decode(v, f"{where}[{i}]") for i, v in enumerate(x)]
    if not isinstance(x, dict):
        return x
    tag = x.get(_TAG)
    if tag is None:
        return {k: _decode(v, f"{where}[{k!r}]") for k, v in x.items()}
    if tag == "parameter":
        return torch.nn.Parameter(x["data"], requires_grad=x["data"].is_floating_point())
    if tag == "ndarray":
        if "data" in x:
            return x["data"].numpy().copy()
        items = [_decode(v, where) for v in x["items"]]
        return np.array(items, dtype=object if x["dtype"] == "object" else np.dtype(x["dtype"])).reshape(x["shape"])
    if tag == "dtype":
        dtype = getattr(torch, str(x["name"]), None)
        if not isinstance(dtype, torch.dtype):  # only dtypes: a name such as 'load' would give a function
            raise ValueError(f"pyro_convexvb.load: {where}: {x['name']!r} is not a torch dtype")
        return dtype
    if tag == "slice":
        return slice(*x["args"])
    if tag == "random_state":
        rs = np.random.RandomState()
        rs.set_state(_decode(x["state"], where))
        return rs
    if tag == "tuple":
        return tuple(_decode(v, where) for v in x["items"])
    if tag == "dict":
        return {_decode(k, where): _decode(v, where) for k, v in zip(x["keys"], x["values"])}
    if tag == "object":
        return _decode_object(x, where)
    if tag == "param_state":
        names = _constraint_names()
        return {"params": dict(x["params"]), "constraints": {k: names[c] for k, c in x["constraints"].items()}}
    raise ValueError(f"pyro_convexvb.load: {where} has the unknown tag {tag!r} (a file from a newer version?)")


def _decode_object(x, where):
    name, version = x.get("class"), x.get("version")
    readers = {n: (v, dec) for _, (n, _, v, dec) in _codecs().items()}
    readers.update({f"online.{n}": (1, _decode_online) for n in _online_classes()})
    readers.update({n: (1, _decode_estimator) for n in _estimator_classes()})
    if name not in readers:
        raise ValueError(f"pyro_convexvb.load: {where} is of class {name!r}, which this version cannot rebuild "
                         f"(known: {sorted(readers)})")
    supported, dec = readers[name]
    if version != supported:
        raise ValueError(f"pyro_convexvb.load: {where} is version {version!r} of {name!r}; this version of "
                         f"pyro_convexvb reads version {supported} (load it with the version that wrote it)")
    return dec(x, where)


# --------------------------------------------------------------------------------------------- codecs
def _codecs():
    """``{class: (name, encode(obj, where), version, decode(state, where))}`` of the library's plain objects."""
    from .infer.convex_relaxation.outer import WhitenedLanczos
    from .infer.convex_relaxation.problem import CovarianceForm
    from .infer.diag_mixture import DiagMixturePosterior
    from .infer.engine import Criterion, Optimality
    from .infer.posterior import GaussianPosterior
    from .infer.result import History, InferenceResult
    from .lgm.layout import LatentBlock, LatentLayout
    from .linalg.lanczos import LanczosResult
    from .linalg.operators import BlockDiagonalOperator, DenseOperator, DiagonalOperator

    return {
        # a posterior read back has no fitting data (nor model): marked so, as compact() marks it
        GaussianPosterior: ("GaussianPosterior", _enc_gaussian, 1, lambda s, w: _dec_gaussian(s, w)._without_data()),
        DiagMixturePosterior: ("DiagMixturePosterior", _enc_mixture, 1,
                               lambda s, w: _dec_mixture(s, w)._without_data()),
        InferenceResult: ("InferenceResult", _enc_result, 1, _dec_result),
        History: ("History", lambda h, w: _obj("History", 1, records=_encode(dict(h), w)), 1,
                  lambda s, w: _dec_history(s)),
        LatentLayout: ("LatentLayout", lambda l, w: _obj("LatentLayout", 1, blocks=[
            [b.name, list(b.shape), int(b.start), int(b.event_dim)] for b in l.blocks]), 1,
            lambda s, w: LatentLayout([LatentBlock(n, tuple(sh), st, ev) for n, sh, st, ev in s["fields"]["blocks"]])),
        Optimality: ("Optimality", lambda o, w: _obj("Optimality", 1, criteria=[
            [c.name, float(c.value), float(c.tol)] for c in o.criteria]), 1,
            lambda s, w: Optimality(tuple(Criterion(n, v, t) for n, v, t in s["fields"]["criteria"]))),
        LanczosResult: ("LanczosResult", _enc_lanczos, 1, _dec_lanczos),
        WhitenedLanczos: ("WhitenedLanczos", lambda z, w: _obj("WhitenedLanczos", 1, result=_encode(z.result, w),
                                                               form=_encode(z.form, w)), 1,
                          lambda s, w: WhitenedLanczos(_decode(s["fields"]["result"], w),
                                                       _decode(s["fields"]["form"], w))),
        CovarianceForm: ("CovarianceForm", _enc_covform, 1, _dec_covform),
        DenseOperator: ("DenseOperator", lambda o, w: _obj("DenseOperator", 1, matrix=o.to_dense()), 1,
                        lambda s, w: DenseOperator(s["fields"]["matrix"])),
        DiagonalOperator: ("DiagonalOperator", lambda o, w: _obj("DiagonalOperator", 1, diag=o.diag), 1,
                           lambda s, w: DiagonalOperator(s["fields"]["diag"])),
        BlockDiagonalOperator: ("BlockDiagonalOperator", lambda o, w: _obj(
            "BlockDiagonalOperator", 1, blocks=[_encode(b, w) for b in o.operators]), 1,
            lambda s, w: BlockDiagonalOperator([_decode(b, w) for b in s["fields"]["blocks"]])),
    }


def _dec_history(s):
    from .infer.result import History

    h = History()
    h.update(_decode(s["fields"]["records"], "history"))
    return h


_GAUSSIAN_REPS = ("covariance", "scale_tril", "precision")


def _enc_gaussian(q, where):
    factors = {k: getattr(q, k, None) for k in ("precision_cholesky", "lanczos")}  # an engine's own (marginals())
    q = q.compact(keep_model=False)
    f = {"loc": q.loc.detach(), "variance": q.variance.detach(), "kind": q.kind,
         "layout": _encode(q.layout, where + ".layout"), "cg_options": _encode(q.cg_options, where)}
    if q.kind in _GAUSSIAN_REPS:
        f["matrix"] = getattr(q, "_" + q.kind).detach()
    elif q.kind == "low_rank":
        f["Q"], f["T"] = q.low_rank[0].detach(), q.low_rank[1].detach()
    elif q.kind == "low_rank_diagonal":
        f["cov_factor"], f["cov_diag"] = q.cov_factor.detach(), q.cov_diag.detach()
    elif q.kind == "precision_operator":
        f["precision_scale"] = q.precision_scale  # the operator itself holds the data: not stored
    f.update({k: _encode(v, f"{where}.{k}") for k, v in factors.items() if v is not None})
    return _obj("GaussianPosterior", 1, **f)


def _dec_gaussian(s, where):
    from .infer.posterior import GaussianPosterior

    f = s["fields"]
    kind, layout = f["kind"], _decode(f["layout"], where)
    common = dict(cg_options=_decode(f["cg_options"], where),
                  **{k: _decode(f[k], where) for k in ("precision_cholesky", "lanczos") if k in f})
    if kind in _GAUSSIAN_REPS:
        return GaussianPosterior(f["loc"], f["variance"], layout=layout, **common, **{kind: f["matrix"]})
    if kind == "low_rank":
        return GaussianPosterior(f["loc"], f["variance"], low_rank=(f["Q"], f["T"]), layout=layout, **common)
    if kind == "low_rank_diagonal":
        return GaussianPosterior(f["loc"], f["variance"], cov_factor=f["cov_factor"], cov_diag=f["cov_diag"],
                                 layout=layout, **common)
    q = GaussianPosterior(f["loc"], f["variance"], layout=layout, **common)
    if kind == "precision_operator":  # saved without its operator: moments only (compact())
        q.kind, q.precision_scale = kind, float(f["precision_scale"])
    elif kind != "diagonal":
        raise ValueError(f"pyro_convexvb.load: {where}: unknown GaussianPosterior kind {kind!r}")
    return q


def _enc_mixture(q, where):
    return _obj("DiagMixturePosterior", 1, locs=q.locs.detach(), variances=q.variances.detach(),
                layout=_encode(q.layout, where + ".layout"))


def _dec_mixture(s, where):
    from .infer.diag_mixture import DiagMixturePosterior

    f = s["fields"]
    return DiagMixturePosterior(f["locs"], f["variances"], layout=_decode(f["layout"], where))


def _enc_result(r, where):
    fields, dropped = {}, []
    for name in ("hyper", "hyperparameters"):
        try:
            fields[name] = _encode(getattr(r, name), f"{where}.{name}")
        except TypeError:
            fields[name] = None
            dropped.append(name)
    kept = r.info_to_store(lambda k, v: _encode(v, f"{where}.info.{k}"), dropped)
    return _obj("InferenceResult", 1, posterior=_encode(r.posterior, where + ".posterior"),
                log_evidence_bound=None if r.log_evidence_bound is None else float(r.log_evidence_bound),
                history=_encode(r.history, where + ".history"), converged=bool(r.converged), engine=str(r.engine),
                info=kept, seconds=float(r.seconds), stop_reason=str(r.stop_reason),
                optimality=_encode(r.optimality, where + ".optimality"), **fields)


def _dec_result(s, where):
    from .infer.result import InferenceResult

    f = {k: _decode(v, f"{where}.{k}") for k, v in s["fields"].items()}
    return InferenceResult(**f)


def _enc_lanczos(z, where):
    return _obj("LanczosResult", 1, Q=z.Q.detach(), T_matrix=z.T_matrix.detach(),
                block_size=int(z.block_size), num_mvm=int(z.num_mvm), breakdown=bool(z.breakdown),
                residual_coeffs=None if z.residual_coeffs is None else z.residual_coeffs.detach(),
                projected_variances=_encode(z.projected_variances, where),
                _eigh=_encode(z._eigh, where), _L=z._L)  # cached factors: predictions identical to the last bit


def _dec_lanczos(s, where):
    from .linalg.lanczos import LanczosResult

    f = dict(s["fields"])
    f["projected_variances"] = _decode(f["projected_variances"], where)
    f["_eigh"] = _decode(f.get("_eigh"), where)
    return LanczosResult(**f)


def _enc_covform(c, where):
    return _obj("CovarianceForm", 1, factor=_encode(c.factor, where + ".factor"), prior_var=c.prior_var,
                site_prior_var=c.site_prior_var, gauss_trace=float(c.gauss_trace), logdet=float(c.logdet),
                dense_fraction=float(c.dense_fraction))


def _dec_covform(s, where):
    from .infer.convex_relaxation.problem import CovarianceForm

    f = dict(s["fields"])
    f["factor"] = _decode(f["factor"], where)
    return CovarianceForm(**f)


# --------------------------------------------------------------------------------------------- online learners
def _online_classes():
    from . import online

    return {name: getattr(online, name) for name in ("OnlineBayesLogistic", "OnlineADF", "OnlineDimGauss",
                                                     "OnlineMarginalVB", "OnlineAdaGradLogistic")}


def _decode_online(s, where):
    name = s["class"].split(".", 1)[1]
    state = _decode(s["fields"]["state"], where)
    return _online_classes()[name].from_state_dict(state)


# --------------------------------------------------------------------------------------------- estimators
def _estimator_classes():
    from .blr import BayesianLinearRegression
    from .glm import GLM
    from .logistic import BayesianLogisticRegression

    return {"BayesianLogisticRegression": BayesianLogisticRegression, "GLM": GLM,
            "BayesianLinearRegression": BayesianLinearRegression}


def _encode_estimator(est, where):
    name = type(est).__name__
    classes = _estimator_classes()
    if classes.get(name) is not type(est):
        raise TypeError(f"pyro_convexvb.save: {where} is a {type(est).__qualname__}; save() stores fitted "
                        f"{sorted(classes)} and the online learners (a GPClassifier predicts from the engine's "
                        "kernel-space factors, which have no plain form: pickle it, trusted files only)")
    params = est.get_params(deep=False)
    for key in ("basis", "kernel"):
        if params.get(key) is not None:
            raise TypeError(f"pyro_convexvb.save: {where} has {key}={type(params[key]).__name__}; a user-supplied "
                            f"{key} is code, which a weights_only file cannot hold: save with {key}=None, or pickle "
                            "the estimator (trusted files only)")
    state = est.__getstate__()  # the compact result_ of CompactPickleMixin
    fitted = {}
    for k, v in state.items():
        if k.endswith("_") and not k.startswith("_"):
            if k == "posterior_" and "result_" in state and v is state["result_"].posterior:
                fitted[k] = {_TAG: "same_as_result_posterior"}
            elif k == "param_state_":  # GLM's param-store scope (unconstrained values and constraints)
                fitted[k] = _encode_param_state(v, f"{where}.{k}")
            else:
                fitted[k] = _encode(v, f"{where}.{k}")
    return _obj(name, 1, params=_encode(params, where + ".get_params()"), fitted=fitted)


def _constraint_names():
    """The parameter constraints a saved param-store state may hold, by name (those of Pyro's autoguides)."""
    from pyro.distributions import constraints

    names = ("real", "real_vector", "positive", "softplus_positive", "unit_interval", "simplex", "lower_cholesky",
             "softplus_lower_cholesky", "unit_lower_cholesky", "positive_definite", "corr_cholesky")
    return {n: getattr(constraints, n) for n in names if hasattr(constraints, n)}


def _encode_param_state(state, where):
    """A Pyro param-store state ``{"params": {name: unconstrained}, "constraints": {name: constraint}}``."""
    names = _constraint_names()
    cons = {}
    for k, c in state.get("constraints", {}).items():
        match = [n for n, ref in names.items() if c is ref or type(c) is type(ref) and repr(c) == repr(ref)]
        if not match:
            raise TypeError(f"pyro_convexvb.save: {where}: the constraint {c!r} of param {k!r} has no plain form "
                            f"(known: {sorted(names)})")
        cons[k] = match[0]
    return {_TAG: "param_state", "params": {k: v.detach() for k, v in state.get("params", {}).items()},
            "constraints": cons}


def _decode_estimator(s, where):
    cls = _estimator_classes()[s["class"]]
    est = cls(**_decode(s["fields"]["params"], where + ".params"))
    fitted = s["fields"]["fitted"]
    for k, v in fitted.items():
        if isinstance(v, dict) and v.get(_TAG) == "same_as_result_posterior":
            continue
        setattr(est, k, _decode(v, f"{where}.{k}"))
    if "posterior_" in fitted and "result_" in fitted and isinstance(fitted["posterior_"], dict) \
            and fitted["posterior_"].get(_TAG) == "same_as_result_posterior":
        est.posterior_ = est.result_.posterior
    return est
