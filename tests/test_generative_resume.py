"""A generative benchmark cell interrupted after a round and resumed ends exactly as an uninterrupted one (issue 43).

Tiny cells on digits: GeFL-F (warm-up, generator, head rounds; a CVAE-F with Adam state carried between
rounds) and image-level GeFL with a DCGAN trained through the target rounds (two optimizers, random noise).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.generative.checkpoint import CHECKPOINT_FILE, PROGRESS_FILE, Fork, current_report, fleet_at, kept_path
from benchmarks.generative.quality import synthetic_accuracy
from benchmarks.generative.runner import run_cell
from fedge.coordinator.report import RoundReport
from fedge.fleet.config import FleetConfig, load_fleet

torch.set_num_threads(1)

# Wall-clock figures differ between any two runs; the resumed cell also records its sessions.
TIMING = ("wall_seconds", "seconds_per_round", "sessions")

GEFLF = ('method = "geflf"\nrounds = 3\n', '[method]\ngenerator = "cvae"\ngenerator_tier = "tiny"\n'
         'warmup_rounds = 1\ngen_rounds = 1\ngen_epochs = 2\n')
GEFL_DCGAN = ('method = "gefl"\nrounds = 3\n', '[method]\ngenerator = "dcgan"\ngenerator_tier = "tiny"\n'
              'gen_rounds = 1\ngen_epochs = 1\ntrain_generator_in_target = true\n')


class Stop(Exception):
    """Stands for the end of a session (the process killed after a round's checkpoint)."""


def tiny_cell(tmp_path: Path, run: str, method: str) -> FleetConfig:
    path = tmp_path / "fleet.toml"
    path.write_text(f'[run]\n{run}dataset = "digits"\nseed = 3\neval_every = 1\n\n'
                    '[partition]\nkind = "iid"\nfraction = 0.25\nlocal_test_fraction = 0.0\n\n'
                    '[train]\nlr = 0.05\nbatch_size = 32\nlocal_epochs = 1\n\n'
                    f'{method}\n[[devices]]\nprofile = "x86-gateway"\ncount = 2\narchs = ["cnn1", "cnn4"]\n')
    return load_fleet(path)


def without_timing(cell: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in cell.items() if k not in TIMING}
    out["synthetic_accuracy"] = {k: v for k, v in out["synthetic_accuracy"].items() if k != "seconds"}
    return out


@pytest.mark.parametrize(("run", "method"), [GEFLF, GEFL_DCGAN], ids=["geflf-cvae", "gefl-dcgan"])
def test_a_cell_resumed_after_round_k_ends_as_an_uninterrupted_one(tmp_path: Path, run: str, method: str) -> None:
    cfg = tiny_cell(tmp_path, run, method)
    expect = {"config": dict(cfg.method), "rounds": cfg.run.rounds}
    whole = run_cell(cfg, checkpoint=tmp_path / "whole", expect=expect)
    assert not (tmp_path / "whole").exists()  # a finished cell's checkpoint is removed
    assert whole["sessions"] == [{"from": 1, "to": 4}]  # 3 training rounds and the final evaluation

    ckpt = tmp_path / "cut"
    trained: list[int] = []

    def stop_after_2(rnd: int) -> None:
        trained.append(rnd)
        if rnd == 2:
            raise Stop

    with pytest.raises(Stop):
        run_cell(cfg, checkpoint=ckpt, expect=expect, after_round=stop_after_2)
    progress = json.loads((ckpt / PROGRESS_FILE).read_text())
    assert progress["completed"] == 2 and progress["total"] == 3
    assert (ckpt / CHECKPOINT_FILE).stat().st_size > 10_000

    resumed = run_cell(cfg, checkpoint=ckpt, expect=expect, after_round=trained.append)
    assert trained == [1, 2, 3, 4]  # the second session ran rounds 3 and the final one only
    assert resumed["sessions"] == [{"from": 1, "to": 2}, {"from": 3, "to": 4}]
    assert without_timing(resumed) == without_timing(whole)
    # the accuracy moved over the run (a cell that learned nothing would match trivially)
    curve = [a for a in whole["acc_curve"] if a is not None]
    assert curve[-1] > curve[0] + 0.05
    # the generator's samples scored by a probe trained on them (benchmarks/generative/quality.py)
    q = whole["synthetic_accuracy"]
    assert q["level"] == ("feature" if "geflf" in run else "image") and q["samples"] == sum(
        whole["per_device"][d]["num_train"] for d in whole["per_device"])
    assert q["acc_real"] > 0.5  # CNN-1 on the fleet's real digits
    assert q["ratio"] == pytest.approx(q["acc_synthetic"] / q["acc_real"])


def test_a_checkpoint_written_under_other_settings_is_set_aside(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tiny_cell(tmp_path, *GEFLF)
    ckpt = tmp_path / "cell"

    def stop(rnd: int) -> None:
        raise Stop

    with pytest.raises(Stop):
        run_cell(cfg, checkpoint=ckpt, expect={"config": {"gen_epochs": 9}}, after_round=stop)
    cell = run_cell(cfg, checkpoint=ckpt, expect={"config": dict(cfg.method)})
    assert cell["sessions"] == [{"from": 1, "to": 4}]  # started over, not resumed after round 1
    assert "written under other settings" in capsys.readouterr().out
    assert (tmp_path / "cell.stale" / CHECKPOINT_FILE).is_file()


def test_a_head_stage_ablation_forked_from_the_base_cell_equals_one_run_from_round_1(tmp_path: Path) -> None:
    """GeFL-F rows differing only in head-round settings share the warm-up and generator rounds: started from
    the base cell's kept checkpoint of round 2 (its last shared round), the ablation ends as if run whole."""
    base = tiny_cell(tmp_path, *GEFLF)
    base_expect = {"config": dict(base.method), "rounds": 3}
    base_cell = run_cell(base, checkpoint=tmp_path / "base", expect=base_expect, keep=[2])
    kept = kept_path(tmp_path / "base", 2)
    assert kept.is_file() and not (tmp_path / "base").exists()  # the kept round outlives the finished cell
    # the CVAE-F and the extractor are frozen after the generator rounds: the kept round's samples score as the
    # finished cell's did
    at_2 = synthetic_accuracy(fleet_at(base, kept), seed=base.run.seed)
    assert at_2 is not None and {k: v for k, v in at_2.items() if k != "seconds"} == without_timing(
        base_cell)["synthetic_accuracy"]

    x3 = tiny_cell(tmp_path, GEFLF[0], GEFLF[1] + "synthetic_ratio = 3.0\n")
    expect = {"config": dict(x3.method), "rounds": 3}
    whole = run_cell(x3, checkpoint=tmp_path / "whole", expect=expect)
    trained: list[int] = []
    forked = run_cell(x3, checkpoint=tmp_path / "forked", expect=expect, fork=Fork(kept, base_expect),
                      after_round=trained.append)
    assert trained == [3, 4]
    assert forked["sessions"][0]["forked_from"] == kept.name
    assert without_timing(forked) == without_timing(whole)
    # ... and the ablation is not the base cell: 3x synthetic samples changed the head rounds
    assert forked["acc_curve"][:3] == base_cell["acc_curve"][:3] and forked["acc_curve"] != base_cell["acc_curve"]
    # a kept checkpoint of other settings is not used: the cell starts at round 1
    trained.clear()
    run_cell(x3, checkpoint=tmp_path / "other", expect=expect, fork=Fork(kept, {"config": {}}),
             after_round=trained.append)
    assert trained == [1, 2, 3, 4]


def test_a_report_pickled_before_a_field_existed_is_restored_with_its_default() -> None:
    """A long cell resumed under newer code: its checkpoint's reports were pickled without ``selection``."""
    old = RoundReport(round=28, phase="head", accepted=["client-1"], metrics={"client-1": {"acc_global": 0.8}})
    del vars(old)["selection"]  # what unpickling a report saved before issue 44 gives
    with pytest.raises(AttributeError):
        _ = old.selection
    new = current_report(old)
    assert new.selection == {}
    assert (new.round, new.phase, new.accepted) == (28, "head", ["client-1"])
    assert new.metrics == {"client-1": {"acc_global": 0.8}}
