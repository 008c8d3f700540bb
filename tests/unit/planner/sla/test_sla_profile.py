"""``--profile-results-dir``: a profile file, or a directory holding exactly one (components/planner/sla_profile.py)."""

from __future__ import annotations

import pytest

from components.perf.model import StepTimeModel
from components.perf.profile import Profile
from components.planner.sla_profile import ProfileResultsError, load_profile_results

pytestmark = pytest.mark.unit

ROUND = StepTimeModel(prefill_base_ms=10.0, prefill_ms_per_token=0.04, prefill_ms_per_token_sq=0.0)


def profile() -> Profile:
    return Profile.build(
        prompt_tokens=[512, 1024, 2048],
        prefill_samples_ms=[[ROUND.prefill_ms(n)] for n in (512, 1024, 2048)],
        batch_sizes=[1, 8],
        context_tokens=[1024, 8192],
        decode_samples_ms=[[[ROUND.decode_ms(b, b * c)] for c in (1024, 8192)] for b in (1, 8)],
        max_num_batched_tokens=8192,
    )


def test_a_file_or_a_directory_with_one_profile_loads(tmp_path):
    prof = profile()
    f = tmp_path / "mock-profile.json"
    prof.save(f)
    (tmp_path / "bench-results.json").write_text('{"not": "a profile"}\n', encoding="utf-8")
    # The profile measured ROUND: a 1024-token prompt in 10 + 0.04 x 1024 = 50.96 ms, from the file or the directory.
    assert load_profile_results(f).prefill_ms(1024) == pytest.approx(50.96)
    assert load_profile_results(tmp_path).prefill_ms(1024) == pytest.approx(50.96)
    assert load_profile_results(str(tmp_path)).max_num_batched_tokens == 8192


def test_no_profile_or_two_are_errors_that_say_what_was_found(tmp_path):
    with pytest.raises(ProfileResultsError, match="no such file or directory"):
        load_profile_results(tmp_path / "missing")
    with pytest.raises(ProfileResultsError, match="holds no `kvmesh profile` JSON file"):
        load_profile_results(tmp_path)
    profile().save(tmp_path / "a.json")
    profile().save(tmp_path / "b.json")
    with pytest.raises(ProfileResultsError, match=r"several profiles \(a.json, b.json\): name one"):
        load_profile_results(tmp_path)
