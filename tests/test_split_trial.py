"""auto's split trial (experts/split_trial.py): decode steps alternate between windows with the hybrid
split and without it; the split stays only when its steps are faster, and the verdict is final."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from ferryman import LLM
from ferryman.calibrate.calibration import save
from ferryman.experts.hybrid import HybridSplit, decide
from ferryman.experts.split_trial import SplitTrial, link_reads_trial
from tiny_models import calibration_of, demo_config, greedy_ids


def _feed(trial: SplitTrial, with_split: float, without: float, steps: int, batch: int = 1) -> list[bool]:
    """`steps` decode steps timed by whether the trial had the split on; the windows they ran in."""
    ran = []
    for _ in range(steps):
        ran.append(trial.on)
        trial.note(with_split if trial.on else without, batch, decode_only=True)
    return ran


def test_windows_alternate_until_each_way_has_enough_steps() -> None:
    trial = SplitTrial(window=3, min_steps=6)
    ran = _feed(trial, 1.0, 1.0, 11)
    assert ran == [True] * 3 + [False] * 3 + [True] * 3 + [False] * 2
    assert trial.verdict is None  # 6 with the split, 5 without
    _feed(trial, 1.0, 1.0, 1)
    assert trial.verdict is False  # equal steps: the split does not pay its costs


@pytest.mark.parametrize("with_split, without, keep", [(9.0, 10.0, True), (9.8, 10.0, False), (11.0, 10.0, False)])
def test_the_split_stays_only_when_faster_by_the_margin(with_split: float, without: float, keep: bool) -> None:
    trial = SplitTrial(window=4, min_steps=8, margin=0.03)
    _feed(trial, with_split, without, 16)
    assert trial.verdict is keep
    assert ("kept" if keep else "fell back") in trial.reason and f"{without * 1e3:.2f} ms without" in trial.reason
    assert all(trial.on is keep for _ in _feed(trial, 1.0, 99.0, 8))  # final: later steps change nothing


def test_prompt_steps_and_other_batch_sizes_are_not_mixed_in() -> None:
    trial = SplitTrial(window=2, min_steps=4)
    for _ in range(20):
        trial.note(50.0, 1, decode_only=False)  # prompt steps: not counted, the window does not move
    assert trial.steps == 0 and trial.on
    # batch 2 runs slower either way: only same-size steps are compared
    for i in range(40):
        batch = 2 if i % 3 == 2 else 1
        trial.note((1.0 if trial.on else 2.0) * batch, batch, decode_only=True)
    assert trial.verdict is True and "1 sequence(s)" in trial.reason
    assert trial.times[(2, True)] == [2.0] * len(trial.times[(2, True)])


def test_auto_split_falls_back_when_its_steps_are_slower() -> None:
    split = HybridSplit(decide("auto", 1000.0, 800.0, "test"))
    assert split.trial is not None and split.active
    for _ in range(200):
        split.note_step(0.012 if split.active else 0.010, 1, True)
        if split.trial.verdict is not None:
            break
    assert not split.decision.enabled and not split.active and not split.applies(1, False)
    assert split.decision.reason.startswith("fell back to offload after a trial")
    assert split.stats()["split_trial"]["verdict"] is False
    forced = HybridSplit(decide("on", 1000.0, 800.0, "test"))  # hybrid asked for: no trial
    assert forced.trial is None and forced.active


def test_engine_steps_feed_the_trial_and_tokens_stay_resident(tmp_path: Path) -> None:
    """Through LLM.generate: each decode step reaches the trial (LLMEngine.step -> note_step), the
    windows switch the split on and off, and the greedy tokens stay the resident engine's."""
    path = tmp_path / "cal.json"
    save(calibration_of(demo_config(), torch.float32, 1000.0, 3000.0), path)
    kw = dict(device="cpu", dtype="float32", max_num_batched_tokens=32)
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42]]
    want = greedy_ids(LLM(**kw), prompts, 24)
    llm = LLM(moe_strategy="offload", expert_cache="10%", **kw)
    llm.engine.runner.rebind_experts(strategy="hybrid", calibration=str(path), cpu_thread=False)
    split = llm.engine.runner.experts.hybrid
    split.decision = dataclasses.replace(split.decision, mode="auto")  # auto's split, which a CPU device never picks
    split.trial = SplitTrial(window=4, min_steps=8)
    assert greedy_ids(llm, prompts, 24) == want
    assert split.trial.steps >= 16 and split.trial.verdict is not None
    assert llm.stats()["experts"]["split_trial"]["steps"] == split.trial.steps
    assert llm.stats()["experts"]["split_trial"]["reason"] == split.trial.reason
    # a trial still running (the split on again): the warm-up's reset restarts it
    split.decision, split.trial = dataclasses.replace(split.decision, enabled=True), SplitTrial(window=4, min_steps=99)
    greedy_ids(llm, prompts[:1], 6)
    assert split.trial.steps == 5
    llm.engine.reset_after_warm_up()
    assert split.trial.steps == 0 and split.trial.times == {}


def test_the_first_steps_of_each_window_are_counted_but_not_timed() -> None:
    """skip: the steps at the start of a window (the cache settling into the window's way) move the
    window on but give no sample; restart forgets the samples until a verdict is in."""
    trial = SplitTrial(window=4, min_steps=4, skip=2)
    ran = _feed(trial, 1.0, 2.0, 12)
    assert ran == [True] * 4 + [False] * 4 + [True] * 4
    assert len(trial.times[(1, True)]) == 4 and len(trial.times[(1, False)]) == 2 and trial.verdict is None
    trial.restart()
    assert trial.steps == 0 and trial.times == {} and trial.on
    _feed(trial, 1.0, 2.0, 16)
    assert trial.verdict is True and trial.steps == 16
    trial.restart()  # a verdict stays
    assert trial.verdict is True and trial.steps == 16


def test_link_reads_trial_keeps_link_on_a_tie_and_names_the_copy_path() -> None:
    """Link reads take no host step between layers: they stay unless copies are clearly faster."""
    tie, slower = link_reads_trial(), link_reads_trial()
    _feed(tie, 1.0, 1.0, 4 * tie.window)
    _feed(slower, 1.1, 1.0, 4 * slower.window)
    assert tie.verdict is True and "kept after a trial" in tie.reason and "ms with link reads" in tie.reason
    assert slower.verdict is False and "fell back to copies" in slower.reason and "ms with copies" in slower.reason
