"""Progress bars that honour `trainer.progress_bar`: tqdm when enabled, a silent stand-in otherwise."""

from __future__ import annotations

from typing import Any

__all__ = ["progress_bar"]


class _NoBar:
    """The part of tqdm's API the trainer uses, doing nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress_bar(enabled: bool, **kwargs: Any):
    """`tqdm.auto.tqdm(**kwargs)` (a context manager with update / set_postfix / close) when `enabled`,
    else a no-op object with the same methods."""
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(**kwargs)
