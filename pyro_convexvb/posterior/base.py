"""The :class:`Posterior` protocol that every posterior type of :mod:`pyro_convexvb.posterior` implements."""
import abc
import copy

__all__ = ["Posterior"]


class Posterior(abc.ABC):
    """What every posterior of this package offers over the flat latent vector ``u`` ``(n,)``.

    Marginal means and variances (:attr:`loc`, :attr:`variance`, :attr:`scale`), draws (:meth:`sample`), a Pyro
    guide (:meth:`as_guide`), and the model it was fitted to (:attr:`layout` maps ``u`` to the model's sites,
    :attr:`model` and :attr:`model_args` let :meth:`as_guide` run the model with its fitting data). An engine
    builds its posterior complete with :meth:`with_model`, a new object; posteriors are not completed in place.

    :ivar loc: mean ``(n,)`` (an attribute or a property).
    :ivar variance: marginal variances ``(n,)`` (an attribute or a property).
    """

    layout = None
    model = None
    model_args = ((), {})
    #: how the draws fill the unused entries of ``obs_mask`` sites: ``"conditional"`` (the posterior covers them with
    #: the site's conditional density, as the latent Gaussian model integrates them) or ``"standard"`` (``N(0, 1)``,
    #: for a posterior fitted on the Pyro model itself); the importance diagnostics weigh them accordingly
    masked_entries = "conditional"
    #: whether the fitting data were dropped (:meth:`compact`, a posterior read back by :func:`pyro_convexvb.load`):
    #: :attr:`model_args` are then empty, not the model's arguments, and nothing may call the model with them
    data_dropped = False

    @property
    @abc.abstractmethod
    def n(self):
        """Length of the latent vector."""

    @property
    def scale(self):
        """Marginal standard deviations ``(n,)``."""
        return self.variance.sqrt()

    @property
    def dtype(self):
        return self.loc.dtype

    @property
    def device(self):
        return self.loc.device

    def unflatten(self, u=None):
        """``{site: value}`` for ``u`` (default: the mean), using the layout, in the posterior's *unconstrained*
        coordinates (``biject_to`` of each support: a positive site appears as its logarithm); the guide's
        ``median()`` (:meth:`as_guide`) gives constrained values."""
        if self.layout is None:
            raise ValueError("this posterior has no latent layout (it was not built from a Pyro model)")
        return self.layout.unflatten(self.loc if u is None else u)

    @abc.abstractmethod
    def sample(self, num_samples=(), generator=None):
        """Draws ``(*num_samples, n)``."""

    @abc.abstractmethod
    def as_guide(self, model=None, *, trainable=True, **kwargs):
        """A Pyro guide over the model's latent sites that samples from this posterior."""

    def compact(self, keep_model=True):
        """A copy without the fitting data ``model_args`` (for pickling; ``keep_model=False`` drops the model too),
        marked :attr:`data_dropped`."""
        return self.with_model(self.model if keep_model else None)._without_data()

    def _without_data(self):
        self.__dict__["data_dropped"] = True
        return self

    def with_model(self, model=None, model_args=((), {}), layout=None):
        """A copy of this posterior bound to the Pyro ``model`` it was fitted to, with its fitting arguments
        ``model_args = (args, kwargs)`` and, when given, its latent ``layout`` (the posterior's own is kept when
        ``layout`` is ``None``). ``self`` is unchanged.

        Example::

            >>> import torch
            >>> from pyro_convexvb.posterior.gaussian import GaussianPosterior
            >>> q = GaussianPosterior(torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64))
            >>> r = q.with_model(print, ((1,), {}))
            >>> r.model is print, r.model_args, q.model
            (True, ((1,), {}), None)
        """
        out = copy.copy(self)
        out.__dict__.update(model=model, model_args=model_args, layout=self.layout if layout is None else layout,
                            data_dropped=False)
        return out

