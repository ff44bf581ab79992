"""Gaussian-process tools: kernels from GPyTorch, GP classification, random-feature GP layers."""
from .predict import gp_classification_model, gp_latent_predictive, kernel_matrix

__all__ = ["gp_classification_model", "gp_latent_predictive", "kernel_matrix"]
