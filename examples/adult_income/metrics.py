"""Exact ROC AUC for the example: the same function ``recserve eval`` reports with."""

from clients.eval_report import roc_auc

__all__ = ["roc_auc"]
