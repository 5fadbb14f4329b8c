"""The rollout progress bar: samples finish in bursts, so it must not extrapolate a rate or an ETA from the first
ones (the default tqdm meter printed an ETA five times the real rollout time). Rendered for real into a buffer."""

from __future__ import annotations

import io

from r3rl.rollout.client import rollout_bar


def render(done: int, total: int) -> str:
    out = io.StringIO()
    bar = rollout_bar(total, step=3, enabled=True, file=out)
    bar.update(done)
    text = str(bar)
    bar.close()
    return text


def test_bar_shows_count_and_elapsed_but_no_eta_or_rate():
    text = render(1, 16)
    assert text.startswith("rollout step 3:") and "1/16" in text and "[00:0" in text, text
    # tqdm writes the ETA as "<remaining" and the rate as "unit/s" (or "?unit/s" before a rate is known)
    assert "<" not in text and "/s" not in text and "?" not in text, text


def test_disabled_bar_writes_nothing():
    out = io.StringIO()
    bar = rollout_bar(4, step=0, enabled=False, file=out)
    bar.update(4)
    bar.close()
    assert out.getvalue() == ""
