"""Gaussian-process tools: kernels from GPyTorch, GP classification, random-feature GP layers."""
from .classifier import GPClassifier, gp_classification_lgm
from .predict import gp_classification_model, gp_latent_predictive, kernel_matrix
from .random_features import RandomFeatureGP, RandomFourierFeatures, orthogonal_gaussian

__all__ = [
    "GPClassifier",
    "RandomFeatureGP",
    "RandomFourierFeatures",
    "gp_classification_lgm",
    "gp_classification_model",
    "gp_latent_predictive",
    "kernel_matrix",
    "orthogonal_gaussian",
]
