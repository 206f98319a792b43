"""A sentence-transformers checkpoint's modules.json decides --runner pooling's pooling when
--pooler-config does not; what cannot be served is refused at start, naming it."""

from __future__ import annotations

import json
import types

import pytest

from ferrylm.cli import pooler_from_args
from ferrylm.config import ConfigError
from ferrylm.model.loaders.st_pooling import CheckpointPooling, sentence_transformers_pooling

TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}


def write(directory, modules, **pooling):
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    config = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
              "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
              "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": False, "include_prompt": True,
              **pooling}
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("mode, kind", [("pooling_mode_mean_tokens", "mean"), ("pooling_mode_lasttoken", "last"),
                                        ("pooling_mode_cls_token", "cls")])
def test_the_pooling_module_picks_the_mode_and_normalize_follows_its_module(tmp_path, mode, kind):
    write(tmp_path, [TRANSFORMER, POOLING, NORMALIZE], **{mode: True})
    assert sentence_transformers_pooling(tmp_path) == CheckpointPooling(kind, True)
    write(tmp_path, [TRANSFORMER, POOLING], **{mode: True})
    assert sentence_transformers_pooling(tmp_path) == CheckpointPooling(kind, False)


def test_no_modules_json_is_no_opinion(tmp_path):
    assert sentence_transformers_pooling(tmp_path) is None


@pytest.mark.parametrize("modules, pooling, named", [
    ([TRANSFORMER, POOLING, {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}, NORMALIZE],
     {"pooling_mode_mean_tokens": True}, "Dense"),
    ([TRANSFORMER, POOLING], {"pooling_mode_max_tokens": True}, "pooling_mode_max_tokens"),
    ([TRANSFORMER, POOLING], {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}, "cls_token"),
    ([TRANSFORMER, POOLING], {}, "none"),
    ([TRANSFORMER, POOLING], {"pooling_mode_lasttoken": True, "include_prompt": False}, "include_prompt"),
    ([TRANSFORMER, NORMALIZE], {}, "one Pooling module"),
    ({"not": "a list"}, {}, "list"),
])
def test_what_cannot_be_served_is_refused_naming_it(tmp_path, modules, pooling, named):
    write(tmp_path, modules, **pooling)
    with pytest.raises(ConfigError, match=named):
        sentence_transformers_pooling(tmp_path)


def test_the_flag_overrides_the_checkpoint_field_by_field(tmp_path):
    write(tmp_path, [TRANSFORMER, POOLING, NORMALIZE], pooling_mode_mean_tokens=True)

    def args(runner="pooling", pooler=None):
        return types.SimpleNamespace(model=str(tmp_path), runner=runner, pooler_config=pooler)

    assert pooler_from_args(args()) == {"runner": "pooling", "pooling_type": "mean", "pooling_normalize": True}
    assert pooler_from_args(args(pooler='{"normalize": false}'))["pooling_normalize"] is False
    assert pooler_from_args(args(pooler='{"pooling_type": "CLS"}'))["pooling_type"] == "cls"
    assert pooler_from_args(args(runner="auto"))["runner"] == "generate"  # a generating server ignores it


def test_a_pooling_type_on_the_command_line_serves_a_checkpoint_it_cannot_run(tmp_path):
    write(tmp_path, [TRANSFORMER, POOLING, NORMALIZE], pooling_mode_max_tokens=True)
    args = types.SimpleNamespace(model=str(tmp_path), runner="pooling", pooler_config='{"pooling_type": "MEAN"}')
    assert pooler_from_args(args) == {"runner": "pooling", "pooling_type": "mean", "pooling_normalize": True}
    with pytest.raises(ConfigError, match="pooling_type picks another"):
        pooler_from_args(types.SimpleNamespace(model=str(tmp_path), runner="pooling", pooler_config=None))
