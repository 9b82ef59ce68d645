"""PromptDataset (verl parquet, validation, over-long prompts) and PromptIterator (seeded epochs, resume)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rllm.experimental.fully_async.data.prompts import DataError, PromptDataset, PromptIterator
from rllm.experimental.fully_async.tasks.addition import (
    build_addition_model,
    build_addition_tokenizer,
    write_addition_parquets,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_addition_tokenizer()


@pytest.fixture(scope="module")
def parquets(tmp_path_factory) -> tuple[Path, Path]:
    return write_addition_parquets(tmp_path_factory.mktemp("addition"), seed=0, num_train=60, num_val=20)


def row(content: str = "12+34=", ground_truth: str | None = "046", **overrides) -> dict:
    data = {
        "prompt": [{"role": "user", "content": content}],
        "data_source": "test",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"index": 0, "split": "train"},
    }
    return data | overrides


def write(tmp_path: Path, rows: list[dict], name: str = "data.parquet") -> Path:
    path = tmp_path / name
    pd.DataFrame(rows).to_parquet(path, index=False)
    return path


# --- loading and validation -------------------------------------------------------------------------------------


def test_loads_verl_parquet_and_tokenizes_with_the_chat_template(parquets, tokenizer):
    dataset = PromptDataset(parquets[0], tokenizer, max_prompt_length=16)
    assert len(dataset) == 60
    record = dataset[0]
    source = pd.read_parquet(parquets[0]).iloc[0]
    expected_ids = tokenizer.apply_chat_template(
        list(source["prompt"]), add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert record.prompt_ids == list(expected_ids)
    assert tokenizer.decode(record.prompt_ids) == source["prompt"][0]["content"]
    assert record.ground_truth == source["reward_model"]["ground_truth"]
    assert record.data_source == "fully_async/addition"
    assert record.extra_info == {"index": 0, "split": "train"}
    assert dataset.rejected == []


def test_several_files_are_concatenated_with_global_row_indices(parquets, tokenizer):
    dataset = PromptDataset(list(parquets), tokenizer, max_prompt_length=16)
    assert len(dataset) == 80
    assert [r.index for r in dataset][58:62] == [58, 59, 60, 61]


def test_missing_file_names_the_file(tmp_path, tokenizer):
    missing = tmp_path / "nope.parquet"
    with pytest.raises(DataError, match=r"nope\.parquet: file not found"):
        PromptDataset(missing, tokenizer, max_prompt_length=16)


def test_unreadable_file_names_the_file(tmp_path, tokenizer):
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"this is not parquet at all")
    with pytest.raises(DataError, match=r"garbage\.parquet: cannot read as parquet") as info:
        PromptDataset(garbage, tokenizer, max_prompt_length=16)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("bad_row", "field"),
    [
        (row(ground_truth=None), "reward_model.ground_truth"),
        (row(data_source=""), "data_source"),
        (row(prompt=[]), "prompt"),
        (row(prompt=[{"role": "user", "content": None}]), r"prompt\[0\]\.content"),
    ],
)
def test_a_bad_row_names_file_row_and_field(tmp_path, tokenizer, bad_row, field):
    path = write(tmp_path, [row(), row(), bad_row])
    with pytest.raises(DataError, match=rf"data\.parquet: row 2: field '{field}'") as info:
        PromptDataset(path, tokenizer, max_prompt_length=16)
    assert "\n" not in str(info.value)


def test_a_missing_column_names_the_field(tmp_path, tokenizer):
    path = write(tmp_path, [{"prompt": [{"role": "user", "content": "1+1="}], "data_source": "t"}])
    with pytest.raises(DataError, match="field 'reward_model' is missing"):
        PromptDataset(path, tokenizer, max_prompt_length=16)


def test_extra_info_is_optional(tmp_path, tokenizer):
    data = row()
    del data["extra_info"]
    dataset = PromptDataset(write(tmp_path, [data]), tokenizer, max_prompt_length=16)
    assert dataset[0].extra_info == {}


def test_overlong_prompts_are_filtered_with_a_reason(tmp_path, tokenizer):
    path = write(tmp_path, [row("1+1="), row("1234567890+1="), row("2+2=")])
    dataset = PromptDataset(path, tokenizer, max_prompt_length=6)
    assert [r.index for r in dataset] == [0, 2]
    (rejected,) = dataset.rejected
    assert (rejected.index, rejected.row, rejected.reason, rejected.prompt_length) == (1, 1, "prompt_too_long", 13)


def test_overlong_prompts_can_be_truncated_from_either_side_or_refused(tmp_path, tokenizer):
    path = write(tmp_path, [row("1234567890+1=")])
    left = PromptDataset(path, tokenizer, max_prompt_length=4, overlong="truncate_left")[0]
    right = PromptDataset(path, tokenizer, max_prompt_length=4, overlong="truncate_right")[0]
    assert tokenizer.decode(left.prompt_ids) == "0+1="
    assert tokenizer.decode(right.prompt_ids) == "1234"
    assert left.truncated and right.truncated
    with pytest.raises(DataError, match="row 0: field 'prompt' is 13 tokens, longer than max_prompt_length=4"):
        PromptDataset(path, tokenizer, max_prompt_length=4, overlong="error")


# --- iteration --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dataset(parquets, tokenizer) -> PromptDataset:
    return PromptDataset(parquets[0], tokenizer, max_prompt_length=16)


def test_each_epoch_visits_every_prompt_once_in_a_seeded_order(dataset):
    draws = list(PromptIterator(dataset, seed=7, num_epochs=2))
    assert len(draws) == 120
    epoch0 = [d.record.index for d in draws[:60]]
    epoch1 = [d.record.index for d in draws[60:]]
    assert sorted(epoch0) == sorted(epoch1) == list(range(60))
    assert epoch0 != epoch1  # reshuffled per epoch
    assert epoch0 != list(range(60))
    assert len({d.prompt_uid for d in draws}) == 120
    assert draws[60].prompt_uid == f"e1/{draws[60].record.index}"
    same_seed = [d.prompt_uid for d in PromptIterator(dataset, seed=7, num_epochs=2)]
    other_seed = [d.prompt_uid for d in PromptIterator(dataset, seed=8, num_epochs=2)]
    assert same_seed == [d.prompt_uid for d in draws]
    assert other_seed != same_seed


def test_unshuffled_iteration_follows_file_order_and_never_ends_without_an_epoch_limit(dataset):
    iterator = PromptIterator(dataset, seed=0, num_epochs=None, shuffle=False)
    draws = iterator.take(150)
    assert [d.record.index for d in draws[:3]] == [0, 1, 2]
    assert draws[149].prompt_uid == "e2/29"
    assert not iterator.exhausted


@settings(max_examples=40, deadline=None)
@given(k=st.integers(0, 180), seed=st.integers(0, 3))
def test_resume_from_state_dict_continues_the_same_sequence(dataset, k, seed):
    reference = [d.prompt_uid for d in PromptIterator(dataset, seed=seed, num_epochs=3)]
    first = PromptIterator(dataset, seed=seed, num_epochs=3)
    head = [d.prompt_uid for d in first.take(k)]
    resumed = PromptIterator(dataset, seed=seed, num_epochs=3)
    resumed.load_state_dict(first.state_dict())
    assert head + [d.prompt_uid for d in resumed] == reference


def test_resume_against_other_data_or_seed_is_refused(dataset):
    state = PromptIterator(dataset, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed"):
        PromptIterator(dataset, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="dataset_size"):
        PromptIterator(dataset.records[:10], seed=1).load_state_dict(state)


# --- tokenized once ---------------------------------------------------------------------------------------------


class CountingTokenizer:
    """The real tokenizer, counting apply_chat_template calls (every other attribute passes through)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.calls = 0

    def apply_chat_template(self, *args, **kwargs):
        self.calls += 1
        return self._tokenizer.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_a_second_load_reuses_the_token_ids_without_the_tokenizer(tmp_path, tokenizer):
    path = write(tmp_path, [row(f"{a}+{a}=", f"{2 * a:03d}") for a in range(10, 40)])
    first = CountingTokenizer(tokenizer)
    loaded = PromptDataset(path, first, max_prompt_length=64)
    assert first.calls >= 1
    assert len(list(tmp_path.glob(".data.parquet.tokens-*.npz"))) == 1, "one cache file beside the data"
    second = CountingTokenizer(tokenizer)
    again = PromptDataset(path, second, max_prompt_length=5, overlong="truncate_left")
    assert second.calls == 0
    # The same ids; length settings apply to the cached ids as they did to fresh ones.
    assert [r.prompt_ids[-5:] for r in loaded] == [r.prompt_ids for r in again]
    assert [r.prompt_ids for r in loaded] == tokenizer.apply_chat_template(
        [r.messages for r in loaded], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_another_tokenizer_or_an_edited_file_tokenizes_again(tmp_path, tokenizer):
    import copy

    path = write(tmp_path, [row("12+34=", "046"), row("11+11=", "022")])
    PromptDataset(path, tokenizer, max_prompt_length=64)
    other = copy.deepcopy(tokenizer)
    other.chat_template = "Q: {% for message in messages %}{{ message['content'] }}{% endfor %}"
    counting = CountingTokenizer(other)
    different = PromptDataset(path, counting, max_prompt_length=64)
    assert counting.calls >= 1
    assert different[0].prompt_ids != PromptDataset(path, tokenizer, max_prompt_length=64)[0].prompt_ids
    write(tmp_path, [row("12+34=", "046"), row("11+11=", "022"), row("10+10=", "020")])
    counting = CountingTokenizer(tokenizer)
    assert len(PromptDataset(path, counting, max_prompt_length=64)) == 3 and counting.calls >= 1


def test_a_damaged_cache_is_a_miss_and_is_rewritten(tmp_path, tokenizer):
    path = write(tmp_path, [row("12+34=", "046")])
    expected = PromptDataset(path, tokenizer, max_prompt_length=64)[0].prompt_ids
    (cache,) = tmp_path.glob(".data.parquet.tokens-*.npz")
    cache.write_bytes(b"not a zip")
    counting = CountingTokenizer(tokenizer)
    assert PromptDataset(path, counting, max_prompt_length=64)[0].prompt_ids == expected and counting.calls >= 1
    counting = CountingTokenizer(tokenizer)
    assert PromptDataset(path, counting, max_prompt_length=64)[0].prompt_ids == expected and counting.calls == 0


def test_a_data_folder_that_cannot_be_written_still_loads(tmp_path, tokenizer, monkeypatch):
    from rllm.experimental.fully_async.data import token_cache

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied", str(dst))

    path = write(tmp_path, [row("12+34=", "046")])
    monkeypatch.setattr(token_cache.os, "replace", refuse)  # as a read-only folder would (root ignores chmod)
    assert len(PromptDataset(path, tokenizer, max_prompt_length=64)) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["data.parquet"], "no cache and no temporary file left"


def test_a_validation_file_with_no_prompt_left_is_refused_before_anything_starts(tmp_path, tokenizer):
    """A held-out file whose every prompt is filtered out made the rollout service die while it was created
    (PromptIterator needs a non-empty dataset); the start-up data check names the file instead."""
    from rllm.experimental.fully_async.runtime.run.prepare import check_data
    from rllm.experimental.fully_async.settings.loader import load_config

    tokenizer.save_pretrained(tmp_path / "tok")
    build_addition_model().config.save_pretrained(tmp_path / "tok")  # a model folder: the start-up check wants one
    train = write(tmp_path, [row("1+1="), row("2+2=")], "train.parquet")
    val = write(tmp_path, [row("1234567890+1=")], "val.parquet")
    overrides = [
        "task.name=null",
        f"actor_rollout_ref.model.path={tmp_path / 'tok'}",
        f"data.train_files={train}",
        "data.max_prompt_length=6",
        "data.filter_overlong_prompts=true",
        "reward.custom_reward_function.path=rllm.experimental.fully_async.tasks.addition",
        "reward.custom_reward_function.name=compute_score",
    ]
    assert check_data(load_config(None, [*overrides, f"data.val_files={train}"], check_host=False)) == 2
    with pytest.raises(DataError, match=r"val\.parquet: no held-out prompt left after filtering"):
        check_data(load_config(None, [*overrides, f"data.val_files={val}"], check_host=False))
