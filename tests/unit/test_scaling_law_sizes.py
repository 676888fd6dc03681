"""The scaling-law fit refuses points that cannot fix the law: fewer than 3 distinct model sizes or token counts."""

import numpy as np
import pytest

from titan_k3.tools.scaling_law import Fit, main

TRUTH = Fit(E=1.7, A=400.0, alpha=0.34, B=1100.0, beta=0.28)


@pytest.mark.parametrize("column", ["params", "tokens"])
def test_points_at_fewer_than_three_sizes_are_refused_not_fitted(tmp_path, capsys, column):
    """At one or two model sizes (or token counts) the power law's coefficients cannot be told from E: the fit printed
    them, and an optimum, with bootstrap intervals as narrow as the noise (every resample holds the same sizes)."""
    N = np.repeat(np.logspace(6, 10, 2 if column == "params" else 4), 2 if column == "tokens" else 4)
    D = np.tile(np.logspace(8, 12, 2 if column == "tokens" else 4), 2 if column == "params" else 4)
    L = TRUTH.loss(N, D)
    pts = tmp_path / "runs.jsonl"
    pts.write_text("\n".join(f'{{"params": {n}, "tokens": {d}, "loss": {l}}}' for n, d, l in zip(N, D, L)))
    assert main([str(pts), "--budget", "1e19", "--bootstrap", "2", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    term = "E, A and alpha" if column == "params" else "E, B and beta"
    assert len(err) == 1 and err[0].startswith(f"error: {pts}: 2 distinct {column} value(s) ("), err
    assert err[0].endswith(f"the fit needs at least 3 to tell {term} apart")
    assert not (tmp_path / "o").exists()


def test_three_sizes_and_three_token_counts_fit():
    from titan_k3.tools.scaling_law import fit

    N = np.repeat(np.logspace(6, 10, 3), 3)
    D = np.tile(np.logspace(8, 12, 3), 3)
    f = fit(N, D, TRUTH.loss(N, D))
    for key, value in vars(TRUTH).items():
        assert getattr(f, key) == pytest.approx(value, rel=1e-3), key
