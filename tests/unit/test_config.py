"""Config loading: defaults < TOML < CLI, one-line errors naming key, value and what is allowed."""

import subprocess
import sys
from pathlib import Path

import pytest

from titan_k3.config import ConfigError, config_to_toml, help_text, load_job_config
from titan_k3.config.manager import field_docs
from titan_k3.config.validate import warmup_updates
from titan_k3.spec import MODEL_FLAVORS

REPO = Path(__file__).resolve().parents[2]


def test_cli_overrides_toml_overrides_defaults(tmp_path):
    toml = tmp_path / "x.toml"
    toml.write_text('[training]\nsteps = 7\nseq_len = 256\n[model]\nflavor = "debug"\n')
    cfg = load_job_config(["--job.config_file", str(toml), "--training.steps", "9"])
    assert (cfg.training.steps, cfg.training.seq_len, cfg.model.flavor) == (9, 256, "debug")
    assert cfg.training.grad_accum == 1  # default kept
    assert load_job_config(["--training.steps=3"]).training.steps == 3


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--training.step", "3"], "unknown config key 'training.step'; did you mean 'training.steps'?"),
        (["--trainig.steps", "3"], "unknown config section 'trainig' (in 'trainig.steps'); did you mean 'training'?"),
        (["--training.steps", "three"], "config key 'training.steps' = 'three': expected an integer"),
        (["--training.steps", "0"], "config key 'training.steps' = 0: must be > 0"),
        (["--kernels.precompile_threads", "-1"], "config key 'kernels.precompile_threads' = -1: must be >= 0"),
        (["--training.seq_len", "100"], "config key 'training.seq_len' = 100: must be a multiple of the KDA chunk size 64"),
        (["--model.flavor", "k3mini"], "did you mean 'k3-mini'?"),
        (["--kernels.kda", "trito"], "expected one of 'auto', 'triton', 'fla', 'torch'; did you mean 'triton'?"),
        (["--parallelism.expert_parallel_degree", "3", "--model.flavor", "debug"], "must divide the 8 experts"),
        (["--lr_scheduler.warmup_steps", "50", "--training.steps", "20"], "must be below training.steps = 20"),
        (["--training.steps", "10", "--lr_scheduler.decay_ratio", "0.01"],
         "config key 'lr_scheduler.decay_ratio' = 0.01: must be above 0.05 with training.steps = 10 (round(0.01 x 10) = 0"),
        (["--training.steps", "10", "--lr_scheduler.warmup_steps", "5", "--lr_scheduler.decay_ratio", "0.9"],
         "config key 'lr_scheduler.decay_ratio' = 0.9: its 9 decay updates and the 5 warmup updates exceed training.steps "
         "= 10; lower it to at most 0.5"),
        (["--data.mixture", "code:0"], "config key 'data.mixture' = 'code:0': every weight is 0"),
        (["--data.mixture", "code:-1,prose:1"], "weights >= 0, 0 excluding a source (bad part 'code:-1')"),
        (["--data.mixture", "code:inf,prose:1"], "(bad part 'code:inf')"),
        (["--training.compute_dtype", "fp8"], "config key 'training.compute_dtype' = 'fp8': expected one of"),
        (["--checkpoint.enable", "false", "--checkpoint.load_step", "5"],
         "config key 'checkpoint.load_step' = 5: no checkpoint is read with checkpoint.enable = false"),
    ],
)
def test_errors_are_one_line_and_name_the_key(argv, expected):
    with pytest.raises(ConfigError) as e:
        load_job_config(argv)
    message = str(e.value)
    assert expected in message
    assert "\n" not in message


@pytest.mark.parametrize("top_k, allowed", [(8, "in 1..7, below its n_experts = 8"), (0, "in 1..7"), (9, "in 1..7")])
def test_a_flavor_whose_top_k_leaves_no_expert_out_is_refused(monkeypatch, top_k, allowed):
    """top_k = n_experts loaded, and the first forward stopped on the router asking for the (top_k + 1)-th score
    (top_k = 0 on a reshape): the flavor is refused with the configuration, naming the key, its value and the range."""
    monkeypatch.setitem(MODEL_FLAVORS["k3"], "wide", {**MODEL_FLAVORS["k3"]["debug"], "top_k": top_k})
    with pytest.raises(ConfigError) as e:
        load_job_config(["--model.flavor", "wide"])
    assert str(e.value).startswith(f"config key 'model.flavor' = 'wide': its top_k = {top_k} (titan_k3/spec.py) must be "
                                   f"{allowed}")
    assert "\n" not in str(e.value)
    monkeypatch.setitem(MODEL_FLAVORS["k3"], "wide", {**MODEL_FLAVORS["k3"]["debug"], "top_k": 7})
    assert load_job_config(["--model.flavor", "wide"]).model.flavor == "wide"


@pytest.mark.parametrize("key", ["crash_at_step", "kill_in_save_at_step", "checkpoint_write_error_at_step"])
@pytest.mark.parametrize("step", [0, 11, -2])
def test_a_fault_at_an_update_the_run_never_makes_is_refused(key, step):
    """debug.crash_at_step = 0 (or past training.steps, or below -1) loaded, was announced as on (>= 0) and never
    fired: the restart it was to test never came."""
    saves = ["--checkpoint.enable", "true"]  # the save faults need a save (the test below)
    with pytest.raises(ConfigError) as e:
        load_job_config(["--training.steps", "10", *saves, f"--debug.{key}", str(step)])
    assert str(e.value) == (f"config key 'debug.{key}' = {step}: must be -1 (off) or an update in 1..training.steps "
                            "= 10")
    assert getattr(load_job_config(["--training.steps", "10", *saves, f"--debug.{key}", "10"]).debug, key) == 10
    assert getattr(load_job_config(["--training.steps", "10", *saves, f"--debug.{key}", "1"]).debug, key) == 1


@pytest.mark.parametrize("key", ["kill_in_save_at_step", "checkpoint_write_error_at_step"])
def test_a_save_fault_where_no_update_saves_is_refused(key):
    """debug.kill_in_save_at_step = 4 with checkpointing off (the default) was taken, announced, and never fired: no
    update saves. A stop signal's save may come after any update (checkpoint.enable or save_on_stop), so with either
    on every update in range is taken, a scheduled save's or not."""
    with pytest.raises(ConfigError) as e:
        load_job_config(["--training.steps", "20", "--checkpoint.interval", "2", f"--debug.{key}", "4"])
    assert str(e.value) == (f"config key 'debug.{key}' = 4: no update saves with checkpoint.enable = false and "
                            "checkpoint.save_on_stop = false, so the fault never fires; set checkpoint.enable = true "
                            "(saves at multiples of checkpoint.interval = 2 and the last update 20), or -1 (off)")
    for saves in (["--checkpoint.enable", "true"], ["--checkpoint.save_on_stop", "true"]):
        for step in ("4", "5", "20"):
            argv = ["--training.steps", "20", "--checkpoint.interval", "2", *saves, f"--debug.{key}", step]
            cfg = load_job_config(argv)
            assert getattr(cfg.debug, key) == int(step)
    assert load_job_config(["--training.steps", "20", "--debug.crash_at_step", "4"]).debug.crash_at_step == 4


@pytest.mark.parametrize("folder", ["config.toml", "./metrics.jsonl/ckpt", "summary", "tensorboard/ckpt",
                                    "events.out.tfevents.1"])
def test_a_checkpoint_folder_on_a_file_the_run_writes_is_refused(folder):
    """checkpoint.folder = 'config.toml' passed --job.validate_only, and the run trained its first update and then
    stopped on a FileExistsError traceback at the save (job.overwrite would also remove a 'summary' or 'tensorboard'
    folder, checkpoints and all)."""
    with pytest.raises(ConfigError) as e:
        load_job_config(["--checkpoint.folder", folder])
    top = folder.removeprefix("./").split("/")[0]
    assert str(e.value) == (f"config key 'checkpoint.folder' = '{folder}': '{top}' is a file or folder the run writes "
                            "at the top of its run directory; name another folder (default 'checkpoints')")
    assert load_job_config(["--checkpoint.folder", "ckpt/config.toml"]).checkpoint.folder == "ckpt/config.toml"


def test_a_mixture_weight_of_zero_excludes_a_source():
    """The loader's own advice for a source left out of data.mixture ('0 excludes it') is a config that loads."""
    assert load_job_config(["--data.mixture", "prose:1,code:0"]).data.mixture == "prose:1,code:0"


def test_seq_len_not_multiple_allowed_with_torch_kda():
    assert load_job_config(["--training.seq_len", "100", "--kernels.kda", "torch"]).training.seq_len == 100


def test_toml_errors_name_the_file(tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_text("[training]\nsteps = 'many'\n")
    with pytest.raises(ConfigError, match=r"bad.toml: config key 'training.steps' = 'many': expected an integer"):
        load_job_config(["--job.config_file", str(toml)])
    toml.write_text("[training\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_job_config(["--job.config_file", str(toml)])
    with pytest.raises(ConfigError, match="no such file"):
        load_job_config(["--job.config_file", str(tmp_path / "missing.toml")])
    toml.write_bytes(b"[job]\nname = 'caf\xe9'\n")  # the whole UnicodeDecodeError's text was the message
    with pytest.raises(ConfigError) as e:
        load_job_config(["--job.config_file", str(toml)])
    assert str(e.value) == f"config key 'job.config_file' = '{toml}': not UTF-8 text (byte 17: invalid continuation byte)"


def test_every_field_has_help_and_roundtrips():
    text = help_text()
    cfg = load_job_config([])
    for section, values in __import__("dataclasses").asdict(cfg).items():
        for key in values:
            assert f"--{section}.{key} " in text
    assert len(field_docs()) == sum(len(v) for v in __import__("dataclasses").asdict(cfg).values())
    again = load_job_config([], toml_text=config_to_toml(cfg))
    assert again == cfg


# Recipes that train on a prepared dataset leave data.dataset empty; they load once one is given.
NEEDS_DATASET = ("pilot.toml", "pretrain.toml")


def _recipe(name):
    extra = ["--data.dataset", "prepared/web"] if f"{name}.toml" in NEEDS_DATASET else []
    return load_job_config(["--job.config_file", str(REPO / "tomls" / f"{name}.toml"), *extra])


def _tokens_per_update(t):
    return t.local_batch_size * t.seq_len * t.grad_accum


def test_recipes_say_what_k3_spec_asks():
    """docs/k3.md §9: each probe's shape, and pilot/pretrain at 32 x 1,024 tokens per update on k3-mini in bf16."""
    smoke, overfit, stability = _recipe("smoke"), _recipe("overfit"), _recipe("stability")
    assert (smoke.training.steps, smoke.training.local_batch_size, smoke.training.seq_len) == (20, 1, 128)
    assert overfit.training.fixed_batch and overfit.training.steps <= 2000
    t = stability.training
    assert (t.steps, t.local_batch_size, t.seq_len, t.grad_accum) == (1000, 1, 128, 4) and not t.fixed_batch
    assert warmup_updates(stability.lr_scheduler, t.steps) > 0 and stability.lr_scheduler.decay_type == "cosine"
    for probe in (smoke, overfit, stability):
        assert probe.model.flavor == "tiny"
    for big in (_recipe("pilot"), _recipe("pretrain")):
        assert big.model.flavor == "k3-mini" and big.model.vocab_size == 163840
        assert big.training.compute_dtype == "bfloat16"
        assert _tokens_per_update(big.training) == 32 * 1024 and big.training.seq_len == 1024
    pretrain = _recipe("pretrain")
    assert pretrain.training.steps * _tokens_per_update(pretrain.training) >= 5e9  # the worklog's 5B tokens
    assert warmup_updates(pretrain.lr_scheduler, pretrain.training.steps) == round(0.01 * pretrain.training.steps)  # 1%


@pytest.mark.parametrize("recipe", sorted(p.relative_to(REPO / "tomls").as_posix() for p in (REPO / "tomls").rglob("*.toml")))
def test_every_recipe_validates_and_keeps_its_values(recipe):
    """Every recipe loads, and each value it sets survives into the resolved config (no key silently dropped)."""
    import tomli

    path = REPO / "tomls" / recipe
    if recipe in NEEDS_DATASET:
        with pytest.raises(ConfigError, match="'data.dataset' is empty: .*python -m titan_k3.data.prepare"):
            load_job_config(["--job.config_file", str(path)])
    given = ["--data.dataset", "prepared/web"] if recipe in NEEDS_DATASET else []
    cfg = load_job_config(["--job.config_file", str(path), *given])
    for section, values in tomli.loads(path.read_text()).items():
        for key, value in values.items():
            if (section, key) != ("data", "dataset") or not given:
                assert getattr(getattr(cfg, section), key) == value, f"{recipe}: {section}.{key}"


def test_config_module_is_torch_free():
    code = "import sys, titan_k3.config, titan_k3.models.k3.args; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_cli_bad_input_exits_2_with_one_line_and_no_run_dir(tmp_path):
    dump = tmp_path / "runs"
    out = subprocess.run(
        [sys.executable, "-m", "titan_k3.train", "--job.dump_folder", str(dump), "--training.seq_len", "100"],
        capture_output=True, text=True, cwd=REPO,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("error: config key 'training.seq_len' = 100")
    assert not dump.exists()


@pytest.mark.parametrize(
    "toml, expected",
    [
        ("[training]\nsteps = true", "config key 'training.steps' = true: expected an integer"),
        ("[kernels]\nkda = false", "config key 'kernels.kda' = false: expected one of 'auto', 'triton', 'fla', 'torch'"),
        ("[training]\nsteps = [1, true]", "config key 'training.steps' = [1, true]: expected an integer"),
        ("[training]\nsteps = { a = 1 }", "config key 'training.steps' = { a = 1 }: expected an integer"),
        ("[training]\nsteps = 1979-05-27", "config key 'training.steps' = 1979-05-27: expected an integer"),
        ("[job]\nstrict = \"it's\"", "config key 'job.strict' = \"it's\": expected true or false"),
        ("[job]\nname = 'C:\\runs'", "config key 'job.name' = 'C:\\runs': must be a plain directory name"),
    ],
)
def test_errors_show_the_value_as_toml_writes_it(tmp_path, toml, expected):
    """A message shows the value as the user wrote it in TOML: true, not Python's True; 'C:\\runs', not 'C:\\\\runs'."""
    path = tmp_path / "x.toml"
    path.write_text(toml + "\n")
    with pytest.raises(ConfigError) as e:
        load_job_config(["--job.config_file", str(path)])
    assert expected in str(e.value)


@pytest.mark.parametrize("value", [True, False, 3, -2.5, 1e-05, float("inf"), "a", "it's", "C:\\x", "a\nb\t'",
                                   [1, "x", [True]], {"a": 1, "b c": "d"}])
def test_toml_value_reads_back_as_the_same_value(value):
    import tomli

    from titan_k3.config.errors import toml_value

    assert tomli.loads(f"v = {toml_value(value)}")["v"] == value


def test_help_writes_defaults_as_toml():
    text = help_text()
    assert "--job.strict (true or false, default false)" in text
    assert "--job.dump_folder (a string, default './runs')" in text
    assert "default True" not in text and "default False" not in text


def test_a_true_or_false_key_alone_means_true():
    """`--job.strict` as written in the docs (it said "option '--job.strict' needs a value")."""
    cfg = load_job_config(["--job.strict", "--training.steps", "3", "--job.validate_only"])
    assert (cfg.job.strict, cfg.job.validate_only, cfg.training.steps) == (True, True, 3)
    assert load_job_config(["--job.strict", "false"]).job.strict is False
    with pytest.raises(ConfigError, match="option '--training.steps' needs a value"):
        load_job_config(["--training.steps", "--job.strict"])


def test_a_value_of_the_toml_file_that_validation_refuses_names_the_file(tmp_path):
    """Reading a file named it ('x.toml: config key ...'), validating its values did not."""
    path = tmp_path / "x.toml"
    path.write_text('[model]\nflavor = "tin"\n[lr_scheduler]\nwarmup_steps = 50\n')
    with pytest.raises(ConfigError) as e:
        load_job_config(["--job.config_file", str(path)])
    assert str(e.value).startswith(f"{path}: config key 'model.flavor' = 'tin': expected one of 'debug', 'tiny', ")
    with pytest.raises(ConfigError) as e:  # set in the file, refused for a value of the command line's
        load_job_config(["--job.config_file", str(path), "--model.flavor", "debug", "--training.steps", "10"])
    assert str(e.value).startswith(f"{path}: config key 'lr_scheduler.warmup_steps' = 50: must be below training.steps")
    with pytest.raises(ConfigError) as e:  # overridden on the command line: the line is the command line's
        load_job_config(["--job.config_file", str(path), "--model.flavor", "tin"])
    assert str(e.value).startswith("config key 'model.flavor' = 'tin'")


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_the_check_command_answers_help(flag):
    """`python -m titan_k3.config.check --help` said "option '--help' needs a value" (exit 2)."""
    out = subprocess.run([sys.executable, "-m", "titan_k3.config.check", flag], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stderr == ""
    assert out.stdout.startswith("usage: python -m titan_k3.config.check [-] [--section.key value ...]")


def test_a_config_file_cannot_name_another(tmp_path):
    """`job.config_file` set in a TOML was dropped without a word (the command line's file wins) and the resolved
    config.toml recorded it as if it had been read: refused, naming the file and the key; a run directory's config.toml,
    which records there the recipe it was resolved from, still reads back."""
    from titan_k3.config.check import config_error

    path = tmp_path / "mine.toml"
    path.write_text('[job]\nconfig_file = "tomls/smoke.toml"\n[training]\nsteps = 5\n')
    with pytest.raises(ConfigError) as e:
        load_job_config(["--job.config_file", str(path)])
    assert str(e.value) == (f"{path}: config key 'job.config_file' = 'tomls/smoke.toml': a config file cannot name "
                            "another (no includes; --job.config_file on the command line names the one file read); "
                            "delete the key there")
    line = config_error([], path.read_text())  # the service's check of inline TOML
    assert line is not None and line.startswith("<inline TOML>: config key 'job.config_file' = 'tomls/smoke.toml':")
    path.write_text('[job]\nconfig_file = ""\n[training]\nsteps = 5\n')  # names none: what a CLI-only run records
    assert load_job_config(["--job.config_file", str(path)]).training.steps == 5

    run = tmp_path / "run"
    run.mkdir()
    recorded = load_job_config(["--job.config_file", "tomls/smoke.toml", "--training.steps", "7"])
    (run / "config.toml").write_text(config_to_toml(recorded))
    assert load_job_config([], toml_text=(run / "config.toml").read_text()).job.config_file == "tomls/smoke.toml"
    with pytest.raises(ConfigError, match="cannot name another"):  # no manifest.json beside it: not a run's
        load_job_config(["--job.config_file", str(run / "config.toml")])
    (run / "manifest.json").write_text("{}")
    again = load_job_config(["--job.config_file", str(run / "config.toml")])
    assert again.training.steps == 7 and again.job.config_file == str(run / "config.toml")


def test_the_trainer_refuses_a_config_file_naming_another_before_any_work(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('[job]\nconfig_file = "tomls/smoke.toml"\n')
    dump = tmp_path / "runs"
    out = subprocess.run([sys.executable, "-m", "titan_k3.train", "--job.config_file", str(path),
                          "--job.dump_folder", str(dump)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 2 and out.stdout == "", out.stdout + out.stderr
    assert out.stderr.splitlines() == [f"error: {path}: config key 'job.config_file' = 'tomls/smoke.toml': a config "
                                       "file cannot name another (no includes; --job.config_file on the command line "
                                       "names the one file read); delete the key there"], out.stderr
    assert not dump.exists()
