"""ttt_linear (arXiv 2407.04620) and titans (arXiv 2501.00663): inner linear models trained online by
mini-batch gradient descent (Titans: with momentum and weight decay)."""

from .api import ttt_linear, ttt_linear_step
from .state import MiniBatchState
from .titans_api import titans, titans_step

__all__ = ["MiniBatchState", "titans", "titans_step", "ttt_linear", "ttt_linear_step"]
