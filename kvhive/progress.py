"""Progress bars (tqdm, on stderr) for the command line's long steps: a generation's prefill and
decode (:class:`GenerationProgress`, a transformers streamer), the trials of ``bench --search``
(:func:`trial_progress`). Shown only where stderr is a terminal and not turned off, so piped or
captured output stays plain lines."""

from __future__ import annotations

import sys

from tqdm.auto import tqdm
from transformers.generation.streamers import BaseStreamer


def progress_wanted(enabled: bool = True) -> bool:
    """Whether to draw a bar: asked for, and stderr is a terminal."""
    stream = sys.stderr
    return bool(enabled) and hasattr(stream, "isatty") and stream.isatty()


class GenerationProgress(BaseStreamer):
    """A bar over one prompt's generation, given to ``model.generate(streamer=...)``: it says
    "prefill of N tokens" (with the time spent) from when ``generate`` receives the prompt until the
    first new token, then counts the new tokens up to ``max_new_tokens``."""

    def __init__(self, max_new_tokens: int, enabled: bool = True) -> None:
        self.bar = tqdm(total=max_new_tokens, unit="token", disable=not progress_wanted(enabled), leave=False)
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:  # generate hands the prompt over first, before the prefill
            self.prompt_seen = True
            self.bar.set_description(f"prefill of {int(value.shape[-1])} tokens")
            return
        if self.bar.n == 0:
            self.bar.set_description("decode")
        self.bar.update(int(value.numel()))

    def end(self) -> None:
        self.bar.close()


def trial_progress(search: str, enabled: bool = True):
    """A bar counting the trials of a capacity search (each a fresh process, seconds to minutes)."""
    return tqdm(desc=f"search {search}: trials", unit="trial", disable=not progress_wanted(enabled), leave=False)
