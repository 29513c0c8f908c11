"""Config composition: groups, file, overrides, and errors that name the key/value and the choices."""
import re
import subprocess
import sys

import pytest
from omegaconf import OmegaConf
from transformers import T5Config

from datamodules.hub import HUB_DATASETS
from decoders import available, build_decoder, decoder_class
from tasks.config import CONFIG_DIR, ConfigError, compose, flatten
from tests.conftest import SPECIAL


def test_groups_file_and_overrides_compose_in_order(tmp_path):
    extra = tmp_path / "extra.yaml"
    extra.write_text("trainer:\n  max_epochs: 5\nmodel:\n  d_model: 64\n")
    cfg = compose("qa", "sequential", str(extra), ["trainer.max_epochs=3", "data.max_train_examples=10"])
    assert cfg.task.name == "qa" and cfg.task.level == "phrase"
    assert cfg.trainer.max_epochs == 3          # override beats file
    assert cfg.model.d_model == 64              # file beats group default
    assert cfg.data.max_train_examples == 10
    assert cfg.decoder.max_new_tokens == cfg.data.max_target_length  # interpolation resolved


def test_group_chosen_by_name_or_by_key():
    assert compose(overrides=["model=t5-small"]).model.hub_id == "google-t5/t5-small"
    assert compose(overrides=["model.name=t5-small"]).model.name == "t5-small"
    cfg = compose(overrides=["data=jsonl", "data.path=/x"])
    assert cfg.data.source == "jsonl" and cfg.data.path == "/x"
    assert "train_size" not in cfg.data          # the builtin group's own keys are gone
    assert cfg.data.max_source_length == 256     # shared data keys stay


def test_trainer_accepts_any_trainer_argument():
    cfg = compose(overrides=["trainer.limit_train_batches=5", "trainer.devices=2",
                             "trainer.strategy=ddp", "trainer.accelerator=cpu"])
    assert cfg.trainer.limit_train_batches == 5 and cfg.trainer.devices == 2


@pytest.mark.parametrize("overrides,needle", [
    (["model.foo=1"], "unknown key 'model.foo'; allowed keys under model:"),
    (["nonsense.key=1"], "unknown key 'nonsense'"),
    (["trainer.bogus=1"], "unknown key 'trainer.bogus'; lightning.Trainer takes"),
    (["trainer.max_epochs=abc"], "trainer.max_epochs='abc' has type str, but trainer.max_epochs takes int"),
    (["train.lr=fast"], "train.lr='fast' has type str"),
    (["trainer.enable_progress_bar=3"], "takes bool"),
    (["model=t5-huge"], "unknown model 't5-huge'; allowed: bart-tiny, marian-tiny, mbart-tiny, "
                        "pegasus-tiny, pretrained, t5-base, t5-large, t5-small, t5-tiny, or a "
                        "save_pretrained folder or hub id (a name with a '/')"),
    (["data=nowhere"], "unknown data 'nowhere'; allowed: builtin"),
    (["decoder=nope"], "unknown decoder 'nope'; allowed: "),
    (["data=jsonl"], "required key(s) not set: data.path"),
    (["data.max_train_examples=0"], "data.max_train_examples must be an integer >= 1 or null (null: all), got 0"),
    (["train.lr=0"], "train.lr must be a finite number > 0, got 0"),
    (["model.lr=-1e-4"], "model.lr must be a finite number > 0, got -0.0001"),
    (["task.level=paragraph"], "unknown key 'task.level'"),
    (["noequals"], "not of the form key=value"),
])
def test_bad_overrides_fail_clearly(overrides, needle):
    with pytest.raises(ConfigError) as err:
        compose("keyphrase", None, None, overrides)
    assert needle in str(err.value)


def test_learning_rate_defaults_to_the_models_and_train_lr_overrides_it():
    # t5-tiny learns from scratch; pretrained T5 is fine-tuned with AdamW at 1e-4 to 3e-4
    assert compose().train.lr == 1e-3
    assert compose(overrides=["model=t5-small"]).train.lr == 3e-4
    assert compose(overrides=["model=t5-large"]).train.lr == 1e-4
    for overrides in (["model=t5-small", "train.lr=1e-5"], ["train.lr=1e-5", "model=t5-small"]):
        assert compose(overrides=overrides).train.lr == 1e-5
    assert compose(overrides=["model=t5-small", "model.lr=2e-4"]).train.lr == 2e-4
    # a checkpoint's configuration keeps the learning rate it was trained with
    stored = OmegaConf.to_container(compose(overrides=["model=t5-small", "train.lr=5e-5"]))
    assert compose(base=stored).train.lr == 5e-5


def test_each_task_sets_its_budget_and_any_override_wins():
    """trainer.max_epochs and, on the built-in corpus, data.train_size come from the task's file."""
    budgets = {task: (compose(task).trainer.max_epochs, compose(task).data.train_size)
               for task in ("keyphrase", "qa", "summarization")}
    assert budgets == {"keyphrase": (10, 2000), "qa": (3, 30000), "summarization": (10, 2000)}
    cfg = compose("qa", overrides=["trainer.max_epochs=3", "data.train_size=100"])
    assert (cfg.trainer.max_epochs, cfg.data.train_size) == (3, 100)
    assert compose("qa", overrides=["task.max_epochs=4"]).trainer.max_epochs == 4
    # other data: the task's epochs stand, the built-in corpus's size does not apply
    cfg = compose("qa", overrides=["data=jsonl", "data.path=somewhere"])
    assert cfg.trainer.max_epochs == 3 and "train_size" not in cfg.data
    with pytest.raises(ConfigError, match="task.builtin_train_size must be an integer >= 1, got 0"):
        compose("qa", overrides=["task.builtin_train_size=0"])


def test_each_task_sets_how_its_training_uses_the_budget():
    """train.lr_decay and train.group_by_length come from the task's file; an override wins."""
    for task, expected in (("keyphrase", (1.0, False)), ("qa", (0.0, True)),
                           ("summarization", (1.0, False))):
        train = compose(task).train
        assert (train.lr_decay, train.group_by_length) == expected
    assert compose("qa", overrides=["task.lr_decay=0.5"]).train.lr_decay == 0.5
    assert compose("qa", overrides=["train.group_by_length=false"]).train.group_by_length is False
    with pytest.raises(ConfigError, match=r"train.lr_decay must be a finite number >= 0 and <= 1 "
                                          r"\(0: a constant rate after warm-up\), got 1.5"):
        compose("qa", overrides=["train.lr_decay=1.5"])


def test_interpolated_default_takes_a_value_of_its_resolved_type():
    cfg = compose("keyphrase", "pipelined", None, ["decoder.max_new_tokens=7"])
    assert cfg.decoder.max_new_tokens == 7
    with pytest.raises(ConfigError, match="decoder.max_new_tokens='many' has type str, but decoder.max_new_tokens "
                                          "takes int"):
        compose("keyphrase", "pipelined", None, ["decoder.max_new_tokens=many"])


DATA_LIMITS = ("max_source_length", "max_target_length", "max_subsequences", "max_subsequence_length")


@pytest.mark.parametrize("name", sorted(HUB_DATASETS))
def test_each_named_dataset_sets_its_length_limits_and_the_decoders_follow_them(name):
    """Limits measured on the dataset (results/data_limits.md), not the defaults; pipelined's slot
    limits and every decoder's output bound are the data limits, overridden or not."""
    own = OmegaConf.load(CONFIG_DIR / "data" / f"{name}.yaml")
    assert set(DATA_LIMITS) <= set(own)
    task = HUB_DATASETS[name].task
    for overrides, limits in (([], own), (["data.max_target_length=50", "data.max_subsequences=5",
                                           "data.max_subsequence_length=7"],
                                          {"max_target_length": 50, "max_subsequences": 5,
                                           "max_subsequence_length": 7})):
        cfg = compose(task, "pipelined", None, [f"data={name}", *overrides])
        assert all(cfg.data[key] == limits[key] for key in DATA_LIMITS if key in limits)
        assert (cfg.decoder.max_subsequences, cfg.decoder.max_subsequence_length,
                cfg.decoder.max_new_tokens) == (limits["max_subsequences"],
                                            limits["max_subsequence_length"], limits["max_target_length"])
        for decoder, option in (("sequential", "max_new_tokens"), ("blockwise", "max_new_tokens"),
                                ("nar", "max_new_tokens"), ("onestep", "max_new_tokens")):
            cfg = compose(task, decoder, None, [f"data={name}", *overrides])
            assert cfg.decoder[option] == limits["max_target_length"]


def test_stored_config_of_an_older_version_gets_new_keys_with_defaults():
    stored = OmegaConf.to_container(compose("keyphrase", "pipelined", None, ["decoder.delay=2"]))
    del stored["model"]["initializer_factor"]  # a key this checkpoint predates
    cfg = compose(None, None, None, [], base=stored)
    assert cfg.model.initializer_factor == 1.0 and cfg.decoder.delay == 2


def test_a_stored_t5_tiny_without_position_heads_had_none():
    """A t5-tiny checkpoint written before `model.position_heads` was initialised without them, with
    as many heads as it says (fewer, here, than today's default names)."""
    stored = OmegaConf.to_container(compose("qa", None, None, ["model.num_heads=4", "model.d_kv=32",
                                                          "model.position_heads.encoder=[-1]"]))
    del stored["model"]["position_heads"]
    cfg = compose(None, None, None, [], base=stored)
    assert cfg.model.num_heads == 4
    assert list(cfg.model.position_heads.encoder) == list(cfg.model.position_heads.decoder) == []


@pytest.mark.parametrize("task_options, model_fields, defaults, set_by_task, set_by_model", [
    (("task.attention_heads.count", "task.attention_heads.dimensions"), ("num_heads", "d_kv"),
     {"keyphrase": (4, 32), "qa": (8, 16), "summarization": (4, 32)}, (2, 64), (16, 8)),
    (("task.decoder_layers", "task.feed_forward_width"), ("num_decoder_layers", "d_ff"),
     {"keyphrase": (2, 512), "qa": (3, 384), "summarization": (2, 512)}, (4, 256), (5, 128)),
])
def test_t5_tiny_takes_its_shape_from_the_task(task_options, model_fields, defaults, set_by_task,
                                               set_by_model):
    """t5-tiny's heads (`task.attention_heads`), decoder depth and feed-forward width
    (`task.decoder_layers`, `task.feed_forward_width`) default to the task's; a task option sets
    them, a model override still wins over it, and a bad value is named."""
    def shape(model):
        return tuple(model[field] for field in model_fields)
    assert {task: shape(compose(task).model) for task in defaults} == defaults
    by_task = [f"{option}={value}" for option, value in zip(task_options, set_by_task)]
    assert shape(compose("keyphrase", overrides=by_task).model) == set_by_task
    by_model = [f"model.{field}={value}" for field, value in zip(model_fields, set_by_model)]
    assert shape(compose("qa", overrides=by_task + by_model).model) == set_by_model
    for option, bad in zip(task_options, (0, -8)):
        with pytest.raises(ConfigError, match=f"{re.escape(option)} must be an integer >= 1, got {bad}"):
            compose("qa", overrides=[f"{option}={bad}"])


def test_t5_tiny_takes_its_attention_implementation_from_the_task():
    """t5-tiny's `model.attn_implementation` defaults to the task's (`task.attention_implementation`:
    eager for QA, sdpa otherwise); a model override still wins, and a bad value is named."""
    assert {task: compose(task).model.attn_implementation
            for task in ("keyphrase", "qa", "summarization")} == {
        "keyphrase": "sdpa", "qa": "eager", "summarization": "sdpa"}
    by_task = compose("keyphrase", overrides=["task.attention_implementation=eager"])
    assert by_task.model.attn_implementation == "eager"
    assert compose("qa", overrides=["model.attn_implementation=sdpa"]).model.attn_implementation == "sdpa"
    with pytest.raises(ConfigError, match="task.attention_implementation='flash'; allowed: eager, sdpa"):
        compose("qa", overrides=["task.attention_implementation=flash"])


@pytest.mark.parametrize("override, message", [
    ("model.position_heads.decoder=[1]", r"model.position_heads.decoder must be offsets <= 0 "
                                         r"\(a decoder head sees only earlier output tokens\), got \[1\]"),
    ("model.position_heads.encoder=[1,2,3,4,5,6,7,8,9]",
     r"model.position_heads.encoder gives 9 offsets, one per head, but model.num_heads is 8"),
    ("model.position_heads.encoder=[-1,next]",
     r"model.position_heads.encoder must be a list of integers \(token offsets\), got \[-1, 'next'\]"),
])
def test_bad_position_heads(override, message):
    with pytest.raises(ConfigError, match=message):
        compose("qa", overrides=[override])


def test_bad_task_and_level():
    with pytest.raises(ConfigError, match="unknown task 'poetry'; allowed: keyphrase, qa, summarization"):
        compose("poetry")
    with pytest.raises(ConfigError, match="task.level='paragraph'; allowed: phrase, sentence"):
        compose("qa", overrides=["task.level=paragraph"])


def test_unknown_key_in_config_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"--config .*bad.yaml: unknown key 'train.learning_rate'"):
        compose(config_file=str(bad))
    with pytest.raises(ConfigError, match="does not exist"):
        compose(config_file=str(tmp_path / "missing.yaml"))


def test_resolved_config_is_frozen_against_typos():
    cfg = compose()
    with pytest.raises(Exception):
        cfg.trainer.max_epoch = 3  # struct mode: a typo cannot add a key silently


def test_base_config_keeps_choices_and_switches_groups():
    stored = {k: v for k, v in flatten(compose("qa")).items()}
    base = compose("qa")
    from omegaconf import OmegaConf
    cfg = compose(overrides=["data=jsonl", "data.path=/d", "data.max_source_length=100"],
                  base=OmegaConf.to_container(base))
    assert cfg.task.name == "qa" and cfg.data.source == "jsonl" and cfg.data.max_source_length == 100
    assert stored["data.source"] == "builtin"


def test_cli_print_config_and_error_exit_code():
    ok = subprocess.run([sys.executable, "-m", "tasks.fit", "--task", "summarization",
                         "--print-config", "trainer.max_epochs=2"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "name: summarization" in ok.stdout and "max_epochs: 2" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "tasks.fit", "--decoder", "nope"],
                         capture_output=True, text=True)
    assert bad.returncode == 2
    assert "unknown decoder 'nope'" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("name", available())
def test_a_decoder_built_from_python_has_its_configuration_groups_options(name):
    """Each option is declared once (`Decoder.options`): a decoder built from Python with no options
    and one built from its composed configuration group at the defaults hold the same values, so
    the constructor's defaults and the YAML group's (interpolated) ones cannot drift apart."""
    cfg = compose("keyphrase", name)
    options = {k: v for k, v in cfg.decoder.items() if k != "name"}
    assert set(options) == set(decoder_class(name).options) | {"compile"}
    from_python = build_decoder(name, T5Config(d_model=32), SPECIAL)
    from_config = build_decoder(name, T5Config(d_model=32), SPECIAL, **options)
    for option in decoder_class(name).options:
        assert getattr(from_python, option) == getattr(from_config, option) == options[option], option


def test_every_decoder_names_its_output_bound_alike():
    for name in available():
        assert "max_new_tokens" in decoder_class(name).options, name
        assert compose("keyphrase", name, None, ["data.max_target_length=33"]).decoder.max_new_tokens == 33


@pytest.mark.parametrize("where", ["override", "file"])
def test_a_former_option_name_is_refused_naming_the_name_now(where, tmp_path):
    extra = tmp_path / "old.yaml"
    extra.write_text("decoder:\n  max_length: 7\n")
    with pytest.raises(ConfigError, match=r"decoder\.max_length is now called decoder\.max_new_tokens"):
        if where == "override":
            compose("keyphrase", "pipelined", None, ["decoder.max_length=7"])
        else:
            compose("keyphrase", "pipelined", str(extra))


def test_a_stored_config_with_a_former_option_name_reads_as_the_name_now(caplog):
    stored = OmegaConf.to_container(compose("keyphrase", "nar"), resolve=True)
    stored["decoder"]["max_length"] = stored["decoder"].pop("max_new_tokens") - 9
    with caplog.at_level("WARNING", logger="tasks"):
        cfg = compose(base=stored)
    assert cfg.decoder.max_new_tokens == stored["decoder"]["max_length"]
    assert "max_length" not in cfg.decoder
    assert "decoder.max_length, which is now decoder.max_new_tokens" in caplog.text
