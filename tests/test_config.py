"""configurator.parse_config and checkpoint.py: config files and overrides, the errors they promise, and atomic,
corruption-checked checkpoints. Plus: every shipped config file parses and builds a valid model."""

import dataclasses
import glob
import os
import subprocess
import sys

import pytest
import torch

import sample
import train
from checkpoint import TRAIN_KEYS, CheckpointError, clean_state_dict, load_checkpoint, save_checkpoint
from configurator import ConfigError, help_text, parse_config, wants_help

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULTS = dict(
    batch_size=12,
    learning_rate=6e-4,
    compile=False,
    dtype="bfloat16",
    wandb_run_name="run",
    n_kv_head=None,
    betas=(0.9, 0.95),
    n_head=4,
    n_embd=128,
)


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_overrides_parse_and_coerce():
    got = parse_config(
        DEFAULTS,
        [
            "--batch_size=32",
            "--learning_rate=1",
            "--compile=True",
            "--dtype=float16",
            "--wandb_run_name=2024",
            "--n_kv_head=2",
            "--betas=(0.9,0.99)",
        ],
    )
    assert got["batch_size"] == 32
    assert got["learning_rate"] == 1.0 and isinstance(got["learning_rate"], float)  # int accepted for a float
    assert got["compile"] is True and got["dtype"] == "float16"
    assert got["wandb_run_name"] == "2024"  # a str default keeps the raw text
    assert got["n_kv_head"] == 2 and got["betas"] == (0.9, 0.99)
    assert DEFAULTS["batch_size"] == 12, "parse_config must not modify the defaults"


def test_config_file_sees_earlier_values_and_overrides_apply_in_order(tmp_path):
    cfg = write(tmp_path, "c.py", "import math\nn_embd = 64 * n_head\nbatch_size = int(math.sqrt(16))\n_private = 3\n")
    got = parse_config(DEFAULTS, ["--n_head=6", cfg, "--batch_size=7"])
    assert got["n_embd"] == 384 and got["batch_size"] == 7
    assert "_private" not in got and "math" not in got


def test_key_space_value_is_key_equals_value(tmp_path):
    """argparse's spelling (`sample.py --cache paged`) means what `--key=value` means, beside config files."""
    cfg = write(tmp_path, "c.py", "n_embd = 64 * n_head\n")
    spaced = parse_config(
        DEFAULTS,
        [
            "--n_head",
            "6",
            cfg,
            "--batch_size",
            "7",
            "--compile=True",
            "--dtype",
            "float16",
            "--wandb_run_name",
            "2024",
            "--learning_rate",
            "-1e-4",
        ],
    )
    joined = parse_config(
        DEFAULTS,
        [
            "--n_head=6",
            cfg,
            "--batch_size=7",
            "--compile=True",
            "--dtype=float16",
            "--wandb_run_name=2024",
            "--learning_rate=-1e-4",
        ],
    )
    assert spaced == joined
    assert spaced["n_embd"] == 384 and spaced["batch_size"] == 7 and spaced["wandb_run_name"] == "2024"
    assert spaced["learning_rate"] == -1e-4
    # A bool key alone is True (argparse's store_true), unless True or False follows it.
    assert parse_config(DEFAULTS, ["--compile", cfg])["compile"] is True
    assert parse_config(DEFAULTS, ["--compile=True", "--compile", "False"])["compile"] is False
    assert parse_config(DEFAULTS, ["--batch_size", "3", "--compile"]) == {**DEFAULTS, "batch_size": 3, "compile": True}
    with pytest.raises(ConfigError, match="override '--n_kv_head=4'"):  # the order check sees the joined form
        parse_config(DEFAULTS, ["--n_kv_head", "4", write(tmp_path, "d.py", "n_kv_head = 1\n")])


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--bach_size=3"], "unknown config key 'bach_size' (did you mean batch_size?)"),
        (["--batch_size=3.5"], "batch_size=3.5 has type float, but batch_size takes type int"),
        (["--compile=1"], "compile=1 has type int, but compile takes type bool"),
        (["--learning_rate=fast"], "learning_rate='fast' has type str"),
        (["--batch_size"], "expected --key=value or --key value"),
        (["--batch_size", "--compile=True"], "override '--batch_size': expected --key=value or --key value"),
        (["--batch_size", "many"], "batch_size='many' has type str, but batch_size takes type int"),
        (["--compile", "1"], "config file '1': no such file"),  # a bool key alone is True; then "1" is an argument
        (["missing_config.py"], "no such file"),
    ],
    ids=[
        "unknown-key",
        "float-for-int",
        "int-for-bool",
        "str-for-float",
        "no-value",
        "no-value-before-override",
        "spaced-wrong-type",
        "bare-bool-then-a-stray-value",
        "missing-file",
    ],
)
def test_bad_arguments_fail_with_clear_message(argv, needle):
    with pytest.raises(ConfigError) as e:
        parse_config(DEFAULTS, argv)
    assert needle in str(e.value)
    if "--" in argv[0] and "=" in argv[0]:
        assert "valid keys: batch_size, betas, compile" in str(e.value)


@pytest.mark.parametrize(
    "script, first_line, note, out_dir",
    [
        (
            "train.py",
            "Train a GPT with MHA, GQA, MQA or MLA attention",
            "\n# I/O\n  --out_dir=out\n  --eval_interval=250  # every this many iterations",
            "out",
        ),
        ("sample.py", "Sample from a trained model (or GPT-2)", "\n  --top_k=200  # 0 = off\n", "''"),
    ],
)
def test_help_lists_the_keys_and_their_defaults(script, first_line, note, out_dir):
    """`--help` / `-h`: the script's docstring (its commands), then every key as it is written on the command line,
    with the headings and notes of the script's DEFAULTS block."""
    for flag in ("--help", "-h"):
        run = subprocess.run(
            [sys.executable, os.path.join(ROOT, script), "configs/gqa.py", flag],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert run.returncode == 0 and run.stderr == "", run.stderr
        assert run.stdout.startswith(first_line)
        assert "\nConfig keys and their defaults" in run.stdout and "\n  --compile=False\n" in run.stdout
        assert "\n  --device=auto" in run.stdout and f"\n  --out_dir={out_dir}\n" in run.stdout and note in run.stdout
        keys = [
            line.split("=")[0].strip()
            for line in run.stdout.split("Config keys")[1].splitlines()[1:]
            if line.startswith("  --")
        ]
        defaults = (train if script == "train.py" else sample).DEFAULTS
        assert sorted(keys) == sorted(f"--{k}" for k in defaults)  # each key once


def test_help_shows_each_default_on_its_own_line(tmp_path):
    """A string default with a newline (sample.py's --start) or spaces is shown as its repr, so that it stays on its
    line; a plain one as typed."""
    source = write(
        tmp_path,
        "script.py",
        'DEFAULTS = dict(\n    start="\\n",  # the prompt\n    name="a b",\n    empty="",\n    plain="out",\n)\n',
    )
    text = help_text("Doc.", dict(start="\n", name="a b", empty="", plain="out"), source)
    assert text.splitlines()[-4:] == [
        "  --start='\\n'  # the prompt",
        "  --name='a b'",
        "  --empty=''",
        "  --plain=out",
    ]


def test_help_is_asked_for_only_outside_values():
    for argv in (
        ["--help"],
        ["-h"],
        ["configs/gqa.py", "--help", "configs/mla.py"],
        ["--compile", "-h"],
        ["--batch_size", "--help"],
    ):
        assert wants_help(argv, DEFAULTS), argv
    for argv in (["--dtype", "-h"], ["--dtype=--help"], ["--batch_size=3"]):  # a value, not a request
        assert not wants_help(argv, DEFAULTS), argv


def test_bad_config_file(tmp_path):
    with pytest.raises(ConfigError, match="unknown config key 'n_layers'"):
        parse_config(DEFAULTS, [write(tmp_path, "a.py", "n_layers = 3\n")])
    with pytest.raises(ConfigError, match="syntax error at line 1"):
        parse_config(DEFAULTS, [write(tmp_path, "b.py", "n_head = = 3\n")])
    with pytest.raises(ConfigError, match="has type str, but n_head takes type int"):
        parse_config(DEFAULTS, [write(tmp_path, "c.py", "n_head = '4'\n")])
    with pytest.raises(
        ConfigError,
        match=r"d\.py': line 2: NameError: name 'n_heads' is not defined.*valid names "
        r"to read: batch_size, betas",
    ):
        parse_config(DEFAULTS, [write(tmp_path, "d.py", "n_head = 8\nn_embd = 64 * n_heads\n")])
    nul, latin = tmp_path / "e.py", tmp_path / "f.py"
    nul.write_bytes(b"n_head = 8\x00\n")
    latin.write_bytes(b"n_head = 8  # caf\xe9\n")
    with pytest.raises(ConfigError, match=r"e\.py': syntax error: source code string cannot contain null bytes"):
        parse_config(DEFAULTS, [str(nul)])
    with pytest.raises(ConfigError, match=r"f\.py': cannot be read as UTF-8 text"):
        parse_config(DEFAULTS, [str(latin)])
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    "files",
    [
        *[[f] for f in sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))],
        *[["configs/kv_h200.py", f"configs/{v}.py"] for v in ("mha", "gqa", "mqa", "mla")],
    ],
    ids=lambda f: "+".join(os.path.basename(x)[:-3] for x in f),
)
def test_shipped_configs_parse_and_build_a_model(files):
    """Each shipped config (and kv_h200 under each variant) parses, gives a GPTConfig and builds its model (on the
    meta device: shapes only), whose KV cache costs per token what the config's fields say in bf16: K and V of
    n_kv_head heads of n_embd // n_head, or MLA's latent and RoPE key, in every layer."""
    import train
    from model import GPT, GPTConfig

    config = parse_config(train.DEFAULTS, [os.path.join(ROOT, f) for f in files])
    gpt_config = train.model_config(config, vocab_size=50257)  # raises ConfigError if the fields disagree
    assert train.run_names(config, gpt_config)[0], (
        "every run has a wandb group, so that a comparison lands on one chart"
    )
    assert isinstance(gpt_config, GPTConfig)
    if config["attention"] == "gqa":
        assert 1 < gpt_config.n_kv_head < gpt_config.n_head
    with torch.device("meta"):
        model = GPT(gpt_config)
    assert model.num_params() > 0
    c = gpt_config
    if c.attention == "mla":
        per_layer = c.kv_lora_rank + c.qk_rope_head_dim
    else:
        per_layer = 2 * c.n_kv_head * (c.n_embd // c.n_head)
    assert model.kv_cache_bytes_per_token() == c.n_layer * per_layer * 2  # bf16, the method's default


def test_variant_configs_share_size_and_budget():
    import train

    keys = (
        "n_layer",
        "n_head",
        "n_embd",
        "block_size",
        "batch_size",
        "gradient_accumulation_steps",
        "max_iters",
        "learning_rate",
        "dataset",
    )
    configs = {
        v: parse_config(train.DEFAULTS, [os.path.join(ROOT, "configs", f"{v}.py")])
        for v in ("mha", "gqa", "mqa", "mla")
    }
    first = configs["mha"]
    for v, c in configs.items():
        assert {k: c[k] for k in keys} == {k: first[k] for k in keys}, v
        assert c["attention"] == v and c["out_dir"] == f"out-{v}"
    names = {v: train.run_names(c, train.model_config(c, vocab_size=256)) for v, c in configs.items()}
    assert {group for group, _ in names.values()} == {"pydoc-L4-E128-H8-T128"}, "one chart for the four runs"
    assert [name for _, name in names.values()] == ["mha", "gqa-kv2", "mqa", "mla-r64"], "as compare.py's rows"


@pytest.mark.parametrize(
    "argv, needle",
    [
        (
            ["--attention=mla", "configs/gqa.py"],
            r"config file '.*gqa\.py' sets attention, which would silently replace the value 'mla' from the earlier "
            r"override '--attention=mla'; valid: put that override after the file",
        ),
        (
            ["--out_dir=/tmp/x", "configs/mha.py", "configs/kv_h200.py"],  # the override lives on in mha.py's out_dir
            r"kv_h200\.py' sets out_dir, which would silently replace the value '/tmp/x-mha' from the earlier "
            r"override '--out_dir=/tmp/x'",
        ),
        (
            ["configs/gqa.py", "configs/kv_h200.py"],  # gqa.py built out-gqa on out_dir: kv_h200.py would drop it
            r"config file '.*kv_h200\.py' sets out_dir, which would silently replace the value 'out-gqa' from the "
            r"earlier config file '.*gqa\.py'; valid: put it after '.*kv_h200\.py'",
        ),
    ],
)
def test_an_order_that_would_drop_a_value_is_refused(argv, needle):
    """Arguments apply left to right: a config file that would silently replace an earlier override, or a value an
    earlier file built on, is refused with the order that works."""
    import train

    argv = [os.path.join(ROOT, a) if a.startswith("configs/") else a for a in argv]
    with pytest.raises(ConfigError, match=needle):
        parse_config(train.DEFAULTS, argv)


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["--n_head=16", "configs/gqa.py"], dict(n_head=16, n_kv_head=4)),
        (["configs/gqa.py", "--n_head=16"], dict(n_head=16, n_kv_head=4)),  # sizes in any order: nothing is stale
        (["configs/gqa.py", "--n_kv_head=1"], dict(n_head=8, n_kv_head=1)),
        (["configs/gqa.py", "--n_head=16", "--n_kv_head=4"], dict(n_head=16, n_kv_head=4)),
        (["--n_kv_head=4", "configs/gqa.py"], dict(n_head=8, n_kv_head=4)),
        (["configs/mla.py", "--n_embd=256"], dict(kv_lora_rank=128, qk_rope_head_dim=16, v_head_dim=32)),
        (["--out_dir=/tmp/x", "configs/gqa.py", "--batch_size=2"], dict(out_dir="/tmp/x-gqa", batch_size=2)),
        (["configs/kv_h200.py", "configs/mla.py", "--out_dir=o"], dict(n_head=16, kv_lora_rank=256, out_dir="o")),
        (["configs/kv_h200.py", "configs/gqa.py"], dict(n_head=16, n_kv_head=4, out_dir="out-kv-gqa")),
        (["configs/gqa.py", "--n_head=8"], dict(n_head=8, n_kv_head=2)),
        (["--attention=gqa", "configs/gqa.py"], dict(attention="gqa")),  # a file repeating an override drops nothing
        (["--wandb_run_name={[1]: 2}"], dict(wandb_run_name="{[1]: 2}")),  # not a literal: the raw text
    ],
)
def test_orders_that_keep_every_value_apply(argv, expect):
    """Orders that drop nothing apply, including ones that set a key to the value it already had; the sizes a
    variant derives (n_kv_head, MLA's dims) come from the model config, whatever the order of the size settings."""
    import train

    argv = [os.path.join(ROOT, a) if a.startswith("configs/") else a for a in argv]
    config = parse_config(train.DEFAULTS, argv)
    config.update(dataclasses.asdict(train.model_config(config, vocab_size=50257)))
    assert {k: config[k] for k in expect} == expect


def test_variant_out_dirs_are_distinct_at_every_size():
    """Each variant file appends its name to the out_dir before it: out-<variant> by default, out-kv-<variant> after
    the GPU size file, so no two runs of a comparison share a directory."""
    import train

    for size in ([], ["configs/kv_h200.py"]):
        dirs = {
            parse_config(train.DEFAULTS, [os.path.join(ROOT, f) for f in (*size, f"configs/{v}.py")])["out_dir"]
            for v in ("mha", "gqa", "mqa", "mla")
        }
        prefix = "out-kv-" if size else "out-"
        assert dirs == {f"{prefix}{v}" for v in ("mha", "gqa", "mqa", "mla")}


# ----------------------------------------------------------------------------------------------- checkpoints


def test_checkpoint_roundtrip_is_atomic_and_weights_only(tmp_path):
    import random

    path = tmp_path / "sub" / "last.pt"
    obj = {"model": {"w": torch.arange(6.0).view(2, 3)}, "rng": {"python": random.getstate()}, "iter_num": 5}
    save_checkpoint(path, obj)
    save_checkpoint(path, dict(obj, iter_num=6))  # overwrite in place
    assert os.listdir(path.parent) == ["last.pt"], "temporary files must be renamed or removed"
    got = load_checkpoint(path)
    assert got["iter_num"] == 6 and torch.equal(got["model"]["w"], obj["model"]["w"])
    assert got["rng"]["python"] == obj["rng"]["python"]


def test_failed_save_leaves_the_old_checkpoint(tmp_path):
    path = tmp_path / "last.pt"
    save_checkpoint(path, {"iter_num": 1})

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        save_checkpoint(path, {"iter_num": 2, "bad": Unpicklable()})
    assert load_checkpoint(path)["iter_num"] == 1
    assert os.listdir(tmp_path) == ["last.pt"]


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "missing", "not-a-dict", "missing-keys"])
def test_corrupt_checkpoint_fails_clearly(tmp_path, damage):
    path = tmp_path / "last.pt"
    save_checkpoint(path, {k: torch.zeros(1000) for k in TRAIN_KEYS} if damage != "not-a-dict" else [1, 2])
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00not a checkpoint" * 100)
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "missing":
        path.unlink()
    elif damage == "missing-keys":
        save_checkpoint(path, {"model": {}})
    expected = {"missing": "no such file", "not-a-dict": "expected a dict", "missing-keys": "missing keys"}
    with pytest.raises(CheckpointError, match=expected.get(damage, "truncated or corrupt")) as e:
        load_checkpoint(path, required_keys=TRAIN_KEYS)
    assert str(path) in str(e.value)


def test_clean_state_dict_strips_compile_and_ddp_prefixes():
    sd = {"module._orig_mod.lm_head.weight": 1, "_orig_mod.transformer.wte.weight": 2, "transformer.h.0.x": 3}
    assert clean_state_dict(sd) == {"lm_head.weight": 1, "transformer.wte.weight": 2, "transformer.h.0.x": 3}


def test_config_file_forms(tmp_path):
    """What a config file may do: helpers (functions too) whose reads are tracked, element-wise tuple assignment,
    `__file__`, annotations; and what it may not: settings inside blocks or by :=, or sys.exit."""
    import train

    def parse(text, *after):
        path = tmp_path / "c.py"
        path.write_text(text)
        return parse_config(train.DEFAULTS, [str(path), *after])

    assert parse("def _kv():\n    return max(1, n_head // 4)\nn_kv_head = _kv()\n", "--n_head=16")["n_kv_head"] == 2
    with pytest.raises(ConfigError, match=r"replace the value 'out-x' from the earlier config file"):
        parse_config(  # a file that builds on out_dir through a helper still carries it on
            train.DEFAULTS,
            [
                write(tmp_path, "a.py", "def _suffix(d):\n    return d + '-x'\nout_dir = _suffix(out_dir)\n"),
                write(tmp_path, "b.py", "out_dir = 'other'\n"),
            ],
        )
    assert parse("n_layer, n_kv_head = 6, max(1, n_head // 4)\n", "--n_layer=2")["n_layer"] == 2  # only n_kv_head read
    assert parse("n_head: int\nout_dir = __file__\n")["out_dir"] == str(tmp_path / "c.py")
    for text in (
        "if n_head >= 16:\n    n_kv_head = 4\nelse:\n    n_kv_head = 2\n",
        "for _ in range(1):\n    batch_size = 4\n",
        "(batch_size := 5)\n",
        "def _f():\n    global batch_size\n    batch_size = 3\n_f()\n",
    ):
        with pytest.raises(
            ConfigError,
            match=r"line \d+: (an assignment inside|`global` in a function).*valid: "
            r"top-level assignments",
        ):
            parse(text)
    assert parse("batch_size = max([b for b in (batch_size, 16)])\n")["batch_size"] == 16  # comprehensions are fine
    with pytest.raises(ConfigError, match=r"line 2: SystemExit"):
        parse("import sys\nsys.exit(3)\n")
    with pytest.raises(ConfigError, match=r"config file '.*': a directory"):
        parse_config(train.DEFAULTS, [str(tmp_path)])
