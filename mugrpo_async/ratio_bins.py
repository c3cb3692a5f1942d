"""The bin layout of the negative-advantage tokens' log10-ratio histogram (``hist_log_ratio_neg_adv`` in the update
records): written by the trainer's metrics (`mugrpo_async.algo.diagnostics`) and read by the study's reports
(`mugrpo_async.reporting.study`). Plain data, no imports: a report reads the records without importing torch.
"""

HIST_DECADES, HIST_PER_DECADE = (-8, 2), 20
"""20 bins a decade over rho in [1e-8, 1e2], plus one below and one above (additive counts, so that a minibatch's
median does not depend on its split)."""


def hist_bin_centre(k: int) -> float:
    """log10 rho at the centre of histogram bin ``k`` (bin 0 holds rho < 1e-8, bins 1..200 the decades' bins, bin
    201 rho >= 100; bins 0 and 201 are placed half a bin outside the range)."""
    lo, hi = HIST_DECADES
    step = 1.0 / HIST_PER_DECADE
    return lo - step / 2 if k == 0 else min(lo + (k - 0.5) * step, hi + step / 2)
