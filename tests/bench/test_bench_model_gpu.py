"""`ds4 bench model` on CUDA: the decode graphs compute the logits, so the benchmark's finite-logits check must stay
out of their capture (else every timed step would run it)."""

import pytest
import torch

from ds4.cli import main

pytestmark = pytest.mark.gpu


def test_the_finite_logits_check_is_not_captured_in_the_decode_graphs(monkeypatch, capsys):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    isfinite, checks = torch.isfinite, {"captured": 0, "eager": 0}

    def counted(t):
        checks["captured" if torch.cuda.is_current_stream_capturing() else "eager"] += 1
        return isfinite(t)

    monkeypatch.setattr(torch, "isfinite", counted)
    argv = ["bench", "model", "--load-format", "dummy", "--device", "cuda", "--context", "24", "--batch-sizes", "1,3"]
    argv += ["--prefill-lengths", "20", "--prefill-chunk", "16", "--decode-steps", "2", "--no-profile"]
    assert main(argv) == 0
    assert "ms/step" in capsys.readouterr().out
    assert checks["captured"] == 0 and checks["eager"] > 0  # checked on the eager steps, never in a graph
