"""Scalar losses with mean reduction; ``backward`` returns the gradient of the prediction."""

from __future__ import annotations

from typing import Any

import numpy

from ..backend import array_module
from .core import Module

__all__ = ["SoftmaxCrossEntropy", "MSELoss"]


def _scalar(loss: Module, grad: Any) -> float:
    """``grad`` (the gradient of the loss, a scalar) as a float, or a TypeError naming ``loss``."""
    if isinstance(grad, (int, float, numpy.integer, numpy.floating)) and not isinstance(grad, bool):
        return float(grad)
    if getattr(grad, "shape", None) == () and getattr(grad, "dtype", numpy.dtype(object)).kind in "iuf":
        return float(grad)
    raise TypeError(f"{type(loss).__name__}.backward: grad is the gradient of the scalar loss "
                    f"and must be a real scalar, got {type(grad).__name__} of shape "
                    f"{getattr(grad, 'shape', None)}")


class SoftmaxCrossEntropy(Module):
    """Mean cross-entropy of ``softmax(logits)`` against integer class targets.

    ``loss = -mean_n log_softmax(logits)[n, target[n]]`` with the log-softmax computed stably
    (shifted by the row maximum).
    """

    def forward(self, logits: Any, target: Any) -> float:
        """Return the mean loss as a Python float.

        Parameters
        ----------
        logits : array of shape (..., C)
            Unnormalized scores.
        target : integer array of shape (...)
            Class indices in ``[0, C)``.

        Raises
        ------
        ValueError
            For mismatched shapes, non-integer targets or targets out of range.
        """
        xp = array_module(logits)
        if logits.ndim < 1 or tuple(target.shape) != tuple(logits.shape[:-1]):
            raise ValueError(
                f"SoftmaxCrossEntropy: targets of shape {tuple(target.shape)} do not match "
                f"logits of shape {tuple(logits.shape)} (expected targets {tuple(logits.shape[:-1])})"
            )
        if not numpy.issubdtype(target.dtype, numpy.integer):
            raise ValueError(f"SoftmaxCrossEntropy: targets must be integers, got {target.dtype}")
        n_classes = logits.shape[-1]
        t = target.reshape(-1)
        if t.size and (int(t.min()) < 0 or int(t.max()) >= n_classes):
            raise ValueError(f"SoftmaxCrossEntropy: targets must lie in [0, {n_classes})")
        logits2d = logits.reshape(-1, n_classes)
        # Shifting by the row maximum keeps exp from overflowing.
        z = logits2d - logits2d.max(axis=1, keepdims=True)
        rows = xp.arange(t.size)
        picked = z[rows, t]
        # z becomes the softmax in place; -log p[target] = log(sum exp z) - z[target].
        xp.exp(z, out=z)
        sums = z.sum(axis=1, keepdims=True)
        z /= sums
        nll = xp.log(sums[:, 0])
        nll -= picked
        self.save_for_backward(z, rows, t, logits.shape)
        return float(nll.mean()) if t.size else 0.0

    def backward(self, grad: float = 1.0) -> Any:
        """Return ``dlogits = grad * (softmax - onehot(target)) / N``."""
        probs, rows, t, shape = self.saved_tensors()
        grad = _scalar(self, grad)
        probs[rows, t] -= 1.0
        probs *= grad / max(t.size, 1)
        return probs.reshape(shape)


class MSELoss(Module):
    """Mean squared error ``mean((pred - target)^2)`` over all elements."""

    def forward(self, pred: Any, target: Any) -> float:
        """Return the mean squared error as a Python float.

        Raises
        ------
        ValueError
            If ``pred`` and ``target`` shapes differ.
        """
        if tuple(pred.shape) != tuple(target.shape):
            raise ValueError(
                f"MSELoss: pred shape {tuple(pred.shape)} != target shape {tuple(target.shape)}"
            )
        diff = pred - target
        self.save_for_backward(diff)
        return float((diff * diff).mean()) if diff.size else 0.0

    def backward(self, grad: float = 1.0) -> Any:
        """Return ``dpred = grad * 2 (pred - target) / N``."""
        (diff,) = self.saved_tensors()
        grad = _scalar(self, grad)
        diff *= 2.0 * grad / max(diff.size, 1)
        return diff
