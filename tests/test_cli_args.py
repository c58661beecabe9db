"""``python -m megatron_harts.workloads`` and ``python -m megatron_harts.demo``: bad numbers and paths
exit 2 with one error line."""
import json

import pytest

from megatron_harts import demo, workloads


@pytest.mark.parametrize("argv,msg", [
    (["tau", "--groups", "0"], "--groups must be >= 1, got 0"),
    (["tau", "--max-tokens", "-1"], "--max-tokens must be >= 1, got -1"),
    (["sweep", "--total-tokens", "-5"], "--total-tokens must be >= 1, got -5"),
    (["sweep", "--compression", "0.5"], "compression must be in (1, 16)"),
    (["tau", "--groups", "1", "--out", "/nonexistent/dir/w.jsonl"], "No such file or directory"),
])
def test_bad_arguments_exit_2_with_one_line(argv, msg, tmp_path, capsys):
    argv = argv + ([] if "--out" in argv else ["--out", str(tmp_path / "w.jsonl")])
    with pytest.raises(SystemExit) as e:
        workloads.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and msg in err and "Traceback" not in err, err


def test_writes_the_batch(tmp_path, capsys):
    out = tmp_path / "w.jsonl"
    assert workloads.main(["tau", "--groups", "2", "--max-tokens", "256", "--out", str(out)]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["groups"] == 2 and s["trajectories"] == len(out.read_text().splitlines()) and s["max_len"] <= 256


@pytest.mark.parametrize("argv,msg", [
    (["--groups", "0"], "--groups must be >= 1, got 0"),
    (["--group-size", "-1"], "--group-size must be >= 1, got -1"),
    (["--chunk-size", "0"], "--chunk-size must be >= 1, got 0"),
])
def test_demo_bad_numbers_exit_2_with_one_line(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        demo.main(argv + ["--no-model"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and msg in err and "Traceback" not in err, err
