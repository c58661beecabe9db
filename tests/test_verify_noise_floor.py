"""``scripts/verify_noise_floor.py``: the CPU bf16 analogue of ``verify --device cuda``'s noise floor.

The floor of K reruns is the largest of the first K differences (a running maximum), so a correct
tree's worst ratio to it can only fall as K grows: a smoke test of the measurement (a floor taken over
the wrong slice of reruns breaks it), not of the claim that four reruns suffice, which is the
measurement's output (docs/benchmarks/verify_mutants.md); the table flags ratios over the gate; bad
arguments get one-line errors."""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("verify_noise_floor", os.path.join(ROOT, "scripts", "verify_noise_floor.py"))
nf = importlib.util.module_from_spec(spec)
spec.loader.exec_module(nf)


@pytest.mark.parametrize("grouped", [False, True])
def test_ratio_falls_with_more_reruns(grouped):
    row = nf.measure(0, grouped, 3, groups=3, group_size=3, prompt_tokens=(20, 40))
    assert row["reruns"] == 3 and row["experts"] == ("grouped" if grouped else "sequential")
    ratios = [row["ratio_by_reruns"][k][1] for k in (1, 2, 3)]
    assert all(r > 0 for r in ratios)
    assert ratios[0] >= ratios[1] >= ratios[2], ratios
    assert row["false_failure"] == {k: v[1] > 3.0 for k, v in row["ratio_by_reruns"].items()}
    md = nf.table([row, {**row, "ratio_by_reruns": {1: ["loss_rel_diff", 4.0], 2: ["x", 1.0], 3: ["x", 1.0]},
                         "false_failure": {1: True, 2: False, 3: False}}], 3.0)
    assert "**4.00** (loss_rel_diff)" in md[3]
    assert md[-1].endswith(f"{1 + row['false_failure'][1]} of 2 with 1 rerun, {int(row['false_failure'][2])} of 2 "
                           f"with 2 reruns, {int(row['false_failure'][3])} of 2 with 3 reruns")


@pytest.mark.parametrize("argv,msg", [(["--seeds", "a"], "--seeds"), (["--experts", "dense"], "--experts"),
                                      (["--reruns", "0"], "--reruns must be >= 1")])
def test_bad_arguments(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        nf.main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err
