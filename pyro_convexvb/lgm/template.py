r"""Extraction templates: one extraction of a model leaves its affine maps for the next extraction at other values.

Integrating over hyper-latents (:mod:`pyro_convexvb.infer.hyper`) extracts the model conditioned on each design
point ``theta_k``. Between points only the numbers that read ``theta`` change (prior scales and precisions, a
likelihood's noise scale or concentration, offsets), while the expensive part of an extraction, the affine maps
``eta = B u + offset`` of the observed sites and ``loc = J x + b`` of the affine Gaussian chains (probed with
autograd products, recognised among ``pcv.linear`` records, composed with the chain), usually does not. An
:class:`ExtractionTemplate` in a model's ``extraction_cache`` (key ``"template"``) keeps those maps, and every
later extraction of a model sharing the cache runs once at the same point ``u0`` of the latent layout (the
extraction's draws are seeded, so ``u0`` is the same at every point) and, per site:

* **recognises** the template's map when the product ``g = d/du sum_i r_i eta_i(u0)`` with a fixed random
  ``r > 0`` equals the template's (relative :data:`CHECK_RTOL`), the site's kept rows (masks) are the same and
  the map is not a function of ``theta``; the site then takes the template's ``B`` and the offset
  ``eta(u0) - B u0``, exactly what a fresh extraction computes (the same ``u0``, the same ``B``);
* **extracts it afresh** otherwise (a design that reads ``theta``: the non-centred ``sigma * z[g]``, an AR
  coefficient that is a hyper-latent; a branch on ``theta``), with every check of a fresh extraction (the second
  run at ``u1``, the affinity test), and keeps the new map as the template's.

Everything else (priors, families, masks, weights, constants, refusals) is computed by the extraction's own code
at every point, so the model is run once per point instead of twice, and the result equals a fresh extraction.
A change of the latent structure (the sites, their shapes, which latents are chain children or integrated out)
drops the template. Each extraction leaves an :class:`ExtractionRecord` saying what was reused, what was
extracted afresh and why.

A map that changes with ``theta`` only in a direction orthogonal to ``r`` would pass the check; for a random
``r`` that has probability zero (the same argument as the extraction's own affinity test at two random points).
"""
import numpy as np
import torch

__all__ = ["ExtractionTemplate", "ExtractionRecord", "CHECK_RTOL"]

#: relative tolerance of the check that a site's affine map is the template's (the extraction's own tolerance for
#: recognising a ``pcv.linear`` record)
CHECK_RTOL = 1e-9
_CHECK_SEED = 7


class ExtractionRecord:
    """What one extraction took from its template.

    :ivar list reused: components whose affine map was the template's (site names; ``"<chain>"`` for the affine
        chain and its composed designs).
    :ivar list built: components extracted afresh because the template had none yet (its first extraction).
    :ivar dict changed: component name -> why its map was extracted afresh although the template had one.
    :ivar str structure: why the template was dropped (the latent structure changed), else ``None``.
    """

    def __init__(self, structure=None):
        self.reused, self.built, self.changed, self.structure = [], [], {}, structure

    @property
    def complete(self):
        """Whether every map came from the template (nothing extracted afresh)."""
        return not self.built and not self.changed and self.structure is None

    def __repr__(self):
        return (f"ExtractionRecord(reused={self.reused}, built={self.built}, changed={self.changed}, "
                f"structure={self.structure!r})")


class _Entry:
    """A component's affine map as an extraction found it, with the product ``g`` that recognises it again."""

    __slots__ = ("rows", "r", "g", "value", "Bu0")

    def __init__(self, rows, r, g, value, Bu0):
        self.rows, self.r, self.g, self.value, self.Bu0 = rows, r, g, value, Bu0


def _vjp(t, u, r):
    g = torch.autograd.grad((t * r).sum(), u, retain_graph=True, allow_unused=True)[0]
    return torch.zeros_like(u).detach() if g is None else g.detach()


def _same_rows(a, b):
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and bool((a == b).all())


class ExtractionTemplate:
    """The affine maps of one extraction, kept for the next extraction of the same model at other values of its
    hyper-latents (see the module docstring).

    Put one in a model's ``extraction_cache`` dict under ``"template"``; :func:`~pyro_convexvb.lgm_from_pyro`
    then fills and uses it. :attr:`record` is the :class:`ExtractionRecord` of the latest extraction.

    Example::

        >>> import pyro, pyro.distributions as dist, torch
        >>> import pyro_convexvb as pcv
        >>> X = torch.randn(20, 3, dtype=torch.float64); y = (X[:, 0] > 0).double()
        >>> def model(s, X, y=None):
        ...     w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=torch.float64), s).to_event(1))
        ...     with pyro.plate("data", 20):
        ...         pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)
        >>> model.extraction_cache = {"template": ExtractionTemplate()}
        >>> a = pcv.lgm_from_pyro(model, 1.0, X, y=y)
        >>> b = pcv.lgm_from_pyro(model, 2.0, X, y=y)  # the design is the first extraction's
        >>> model.extraction_cache["template"].record.reused, b.sites[0].design is a.sites[0].design
        (['y'], True)
    """

    def __init__(self):
        self.key = None
        self.entries = {}  # (kind, name) -> _Entry
        self.chain = None  # (signature, AffineChain)
        self.composed = {}  # group name -> (design acting on the sites x, design acting on u)
        self.record = None
        self._note = None

    def note_structure_change(self, reason):
        """The model's sample sites changed since the structure trace (the extraction traces it again)."""
        self._note = reason

    def begin(self, key):
        """Start an extraction whose latent structure is ``key``; a template of another structure is dropped.

        :returns: the extraction's :class:`ExtractionRecord` (also :attr:`record`)."""
        reason, self._note = self._note, None
        if self.key is not None and self.key != key:
            reason = reason or "the latent sites, their shapes or their roles (chain children, integrated out) changed"
        if reason is not None or self.key != key:
            self.entries.clear()
            self.chain = None
            self.composed.clear()
        self.key = key
        self.record = ExtractionRecord(reason)
        return self.record

    # ------------------------------------------------------------------ affine maps of sites and chain children
    def lookup(self, kind, name, t, u, rows=None):
        """The template's entry for component ``name`` if ``t`` (its predictor or mean at ``u``, with its autograd
        graph) is recognised as the same affine map on the same ``rows``, else ``None`` (noted in the record)."""
        e = self.entries.get((kind, name))
        if e is None:
            return None
        reason = None
        if not _same_rows(e.rows, rows):
            reason = "its observed rows (masks, weights) changed"
        else:
            sel = t if rows is None else t[rows]
            if sel.shape != e.r.shape or not torch.is_tensor(sel) or not sel.requires_grad:
                reason = "its affine map changed"
            else:
                g = _vjp(sel, u, e.r)
                err = float((g - e.g).abs().max()) if g.numel() else 0.0
                ref = float(e.g.abs().max()) if e.g.numel() else 0.0
                if not np.isfinite(err) or err > CHECK_RTOL * (1.0 + ref):
                    reason = ("its affine map changed (it depends on the hyper-latents, e.g. a scale multiplying a "
                              "latent in a non-centred form)")
        if reason is not None:
            self.record.changed[name] = reason
            return None
        self.record.reused.append(name)
        return e

    def store(self, kind, name, t, u, rows, value, Bu0):
        """Keep component ``name``'s map ``value`` (and ``B u0``, from which offsets follow) with its check."""
        sel = t if rows is None else t[rows]
        gen = torch.Generator().manual_seed(_CHECK_SEED)
        r = (torch.rand(sel.shape, generator=gen, dtype=sel.dtype) + 0.5).to(sel.device)
        self.entries[(kind, name)] = _Entry(None if rows is None else rows.clone(), r, _vjp(sel, u, r), value,
                                            Bu0.detach())
        if name not in self.record.changed:
            self.record.built.append(name)

    # ------------------------------------------------------------------ the affine chain
    def chain_for(self, signature, build):
        """The template's :class:`~pyro_convexvb.lgm.chains.AffineChain` if its ``signature`` (coefficients,
        children, intrinsic blocks) is the same, else ``build()`` (kept)."""
        if self.chain is not None and _same_signature(self.chain[0], signature):
            self.record.reused.append("<chain>")
            return self.chain[1]
        if self.chain is not None:
            self.record.changed["<chain>"] = "its coefficients changed (they depend on the hyper-latents)"
        else:
            self.record.built.append("<chain>")
        chain = build()
        self.chain = (signature, chain)
        self.composed.clear()
        return chain

    def compose(self, chain, name, design):
        """``chain.design(design)``, the template's when the chain and the site's design are the template's."""
        hit = self.composed.get(name)
        if hit is not None and hit[0] is design and self.chain is not None and self.chain[1] is chain:
            return hit[1]
        out = chain.design(design)
        self.composed[name] = (design, out)
        return out


def _same_signature(a, b):
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and x.shape == y.shape
                    and np.array_equal(x, y)):
                return False
        elif isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
            if not _same_signature(x, y):
                return False
        elif x is not y and x != y:
            return False
    return True
