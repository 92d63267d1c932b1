"""bench/bench_backend_lifecycle.py runs a real backend start and stop and reports both."""
import json

import pytest

from bench import bench_backend_lifecycle as bl


def test_one_round_reports_a_start_and_a_stop(capsys):
    assert bl.main(["--rounds", "1", "--groups", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rounds"] == 1 and out["groups"] == 1
    assert 0 < out["start_s"]["median"] and 0 < out["stop_s"]["median"] < 10, out


def test_no_rounds_is_a_usage_error():
    with pytest.raises(SystemExit) as exc:
        bl.main(["--rounds", "0"])
    assert exc.value.code == 2
