import importlib.resources as resources

import pytest
import yaml

from szo.config import apply_overrides, load_recipe, parse_override, recipe_names, write_config
from szo.methods import list_methods

SHIPPED = ["digits-bp", "digits-scratch", "digits-continual", "cifar10-bp", "cifar10-scratch", "cifar100-bp",
           "cifar100-scratch", "cifar100-continual", "imagenet-bp", "imagenet-scratch", "imagenet-continual",
           "dvs-gesture-bp", "dvs-gesture-scratch", "mnist5k-bp", "mnist5k-scratch", "mnist5k-continual",
           "nmnist-bp", "nmnist-scratch", "shd-bp", "shd-scratch"]


def test_recipes_found_via_importlib_resources():
    files = {p.name for p in resources.files("szo._recipes").iterdir()}
    assert {f"{n}.yaml" for n in SHIPPED} <= files
    assert set(SHIPPED) <= set(recipe_names())


@pytest.mark.parametrize("name", recipe_names())
def test_every_recipe_loads_and_validates(name):
    cfg = load_recipe(name)
    assert cfg["name"] == name and cfg["model"]["name"] and cfg["data"]["name"]


def test_paper_hyperparameters():
    c = load_recipe("cifar10-scratch")
    assert (c["model"]["name"], c["subspace"]["k"], c["train"]["epochs"], c["train"]["lr"], c["szo"]["mu"],
            c["train"]["momentum"], c["train"]["weight_decay"], c["data"]["batch_size"]) == \
        ("spike_resnet20", 60, 40, 1.0, 1.0, 0.9, 0.0, 128)
    assert c["bptt"]["lr"] == 0.1 and c["bptt"]["weight_decay"] == 1e-4 and c["subspace"]["window"] == "0-149"
    c = load_recipe("cifar100-continual")
    assert (c["mode"], c["bptt"]["epochs"], c["subspace"]["window"], c["subspace"]["k"], c["subspace"]["reference"],
            c["train"]["epochs"]) == ("continual", 100, "80-100", 20, "last", 20)
    c = load_recipe("imagenet-bp")
    assert (c["data"]["batch_size"], c["bptt"]["epochs"], c["model"]["name"]) == (512, 100, "spike_resnet50")
    c = load_recipe("dvs-gesture-scratch")
    assert (c["model"]["T"], c["data"]["batch_size"], c["subspace"]["k"]) == (20, 16, 20)


PAPER_SCALE = ("cifar10-scratch", "cifar100-scratch", "cifar100-continual", "imagenet-scratch", "imagenet-continual",
               "dvs-gesture-scratch", "nmnist-scratch", "cifar10c-tta", "cifar100c-tta", "imagenetc-tta")
RELATIVE = ("szo-cge", "szo-rge", "szo-1pt", "szo-cge-1pt", "bp-subspace")


@pytest.mark.parametrize("name", PAPER_SCALE)
def test_paper_scale_recipes_keep_the_papers_units(name):
    """The recipes that reproduce the paper's tables pin its units (App. G): absolute, mu 1, lr 1 (TTA 1 / 0.1)."""
    c = load_recipe(name)
    assert (c["szo"]["scale"], c["szo"]["mu"]) == ("absolute", 1.0)
    if c["kind"] == "tta":
        assert (c["tta"]["lr_reset"], c["tta"]["lr_continual"]) == (1.0, 0.1)
        return
    for method in RELATIVE:
        assert load_recipe(name, [f"method={method}"])["train"]["lr"] == 1.0


def test_the_small_recipes_take_the_relative_scale_for_the_subspace_methods_only():
    """szo.scale unset: trajectory (mu 0.3, lr 0.03) for the five relative methods with the float learner,
    absolute for every other method and the integer learner; an explicit relative scale where it does not
    apply is refused; an explicit absolute is the paper's units with App. G's 1.0."""
    small = [n for n in recipe_names() if load_recipe(n)["kind"] == "subspace" and n not in PAPER_SCALE
             and n not in ("digits-fixed", "digits-c-mcu")]
    assert {"digits-scratch", "digits-continual", "mnist5k-scratch", "mnist5k-continual", "fmnist-scratch",
            "fmnist-continual"} <= set(small)
    for name in small:
        for method in RELATIVE:
            c = load_recipe(name, [f"method={method}"])
            mu = 0.3 if method != "bp-subspace" else 1.0  # BP-Subspace does not probe
            assert (c["szo"]["scale"], c["szo"]["mu"], c["train"]["lr"]) == ("trajectory", mu, 0.03), (name, method)
            a = load_recipe(name, [f"method={method}", "szo.scale=absolute"])
            assert (a["szo"]["mu"], a["train"]["lr"]) == (1.0, 1.0), (name, method)
        for method in ("zo-cge", "tt-zo", "fg-subspace", "np-zo"):
            assert load_recipe(name, [f"method={method}"])["szo"]["scale"] == "absolute"
    assert load_recipe("digits-scratch", ["method=szo-rge"])["train"]["epochs"] == 60  # its budget stays
    assert load_recipe("fmnist-scratch", ["method=szo-rge"])["szo"]["q"] == 10
    for name in ("digits-c-tta", "mnist5k-c-tta", "fmnist-c-tta"):
        c = load_recipe(name)
        assert (c["szo"]["scale"], c["szo"]["mu"]) == ("trajectory", 0.3)
        assert load_recipe(name, ["method=bn,tent"])["szo"]["scale"] == "absolute"  # no subspace method
    with pytest.raises(ValueError, match="szo.scale 'trajectory' .* does not apply here"):
        load_recipe("digits-scratch", ["method=zo-cge", "szo.scale=trajectory"])
    # the fixed-point recipes stay in the paper's units: the integer learner has its own
    assert load_recipe("digits-fixed")["szo"]["scale"] == "absolute"
    assert (load_recipe("digits-fixed", ["method=szo-rge"])["szo"]["mu"],
            load_recipe("digits-fixed", ["method=szo-rge"])["train"]["lr"]) == (0.3, 0.02)
    assert load_recipe("digits-c-mcu", ["method=szo-cge", "hw.blocks=null"])["szo"]["scale"] == "absolute"


def test_mnist5k_recipes():
    c = load_recipe("mnist5k-scratch")
    assert (c["model"]["name"], c["model"]["T"], c["data"]["name"], c["subspace"]["name"], c["subspace"]["k"],
            c["train"]["epochs"], c["szo"]["mu"], c["method"]) == \
        ("spike_resnet8", 4, "mnist5k", "mnist5k-resnet8-k20", 20, 4, 0.3, "szo-cge")
    z = load_recipe("mnist5k-scratch", ["method=zo-rge"])
    assert z["szo"]["q"] == 20 and 2 * z["szo"]["q"] == 2 * c["subspace"]["k"]  # SZO-CGE's forward budget
    c = load_recipe("mnist5k-continual")
    assert (c["mode"], c["subspace"]["reference"], c["subspace"]["window"]) == ("continual", "last", "6-10")


def test_overrides_parse_yaml_values():
    c = load_recipe("digits-scratch", ["train.epochs=3", "szo.mu=0.5", "data.data_dir=null", "progress=false",
                                       "method=szo-rge", "szo.q=10", "train.lr=1e-3", "model.kwargs={width: 8}"])
    assert c["train"]["epochs"] == 3 and c["szo"]["mu"] == 0.5 and c["data"]["data_dir"] is None
    assert c["progress"] is False and c["method"] == "szo-rge" and c["szo"]["q"] == 10
    assert c["train"]["lr"] == pytest.approx(1e-3) and c["model"]["kwargs"] == {"width": 8}
    assert parse_override("a.b= 3 ") == ("a.b", 3)
    # method default learning rates: the relative 0.03 for the subspace methods (their default scale,
    # trajectory), 1 for full-space ZO (App. G), bptt.lr for full-space BP
    assert load_recipe("digits-scratch")["train"]["lr"] == 0.03
    assert load_recipe("digits-scratch", ["szo.scale=absolute"])["train"]["lr"] == 1.0
    assert load_recipe("digits-scratch", ["method=zo-rge"])["train"]["lr"] == 0.1  # its method_defaults
    assert load_recipe("digits-continual", ["method=zo-rge"])["train"]["lr"] == 1.0
    assert load_recipe("digits-scratch", ["method=bp"])["train"]["lr"] == 0.1


def test_unknown_key_lists_valid_keys_one_line():
    with pytest.raises(ValueError) as e:
        load_recipe("digits-bp", ["train.epoch=3"])
    msg = str(e.value)
    assert "\n" not in msg and "unknown key 'train.epoch'" in msg
    assert "valid keys under 'train': epochs, scheduler" in msg
    with pytest.raises(ValueError, match="valid keys at the top level: name"):
        apply_overrides({}, ["trian.epochs=1"])


@pytest.mark.parametrize("override,match", [
    ("method=sgd", "valid: bp, bp-subspace, szo-cge"),
    ("loss.name=mse", "valid: tet, ce, rate-mse, entropy"),
    ("device=tpu", "valid: cpu, cuda"),
    ("data.name=mnist", "valid: .*digits"),
    ("model.name=resnet", "valid: .*spike_convnet"),
    ("train.epochs=0", ">= 1"),
    ("train.epochs=two", "must be int"),
    ("kind=gan", "valid: bp, subspace"),
    ("train.weight_decay=0.1", "no weight decay"),
    ("szo.time_chunk=0", "'szo.time_chunk' must be >= 1"),
    ("szo.time_chunk=one", "'szo.time_chunk' must be int"),
    ("szo.stream_bn=tdbn", "invalid szo.stream_bn 'tdbn'; valid: exact, running, chunk"),
    ("model.memory_format=nhwc", "invalid model.memory_format 'nhwc'; valid: auto, channels_last, contiguous"),
])
def test_invalid_choices(override, match):
    with pytest.raises(ValueError, match=match):
        load_recipe("digits-scratch", [override])


def test_unknown_recipe_lists_valid_names():
    with pytest.raises(ValueError, match="unknown recipe 'nope'; valid recipes: .*digits-bp"):
        load_recipe("nope")


def test_yaml_file_with_extends_and_resolved_config_roundtrip(tmp_path):
    p = tmp_path / "mine.yaml"
    p.write_text("extends: digits-scratch\nname: mine\ntrain: {epochs: 2}\n")
    c = load_recipe(p)
    assert c["name"] == "mine" and c["train"]["epochs"] == 2 and c["subspace"]["k"] == 20
    write_config(c, tmp_path / "config.yaml")
    again = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert again == c
    assert load_recipe(tmp_path / "config.yaml") == c


def test_method_defaults_apply_only_to_their_method_and_yield_to_set(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("extends: digits-scratch\nname: m\n"
                 "method_defaults:\n  szo-rge: {szo: {mu: 0.25}, train: {lr: 0.03}}\n")
    cge = load_recipe(p)
    assert cge["method"] == "szo-cge" and cge["szo"]["mu"] == 0.3 and cge["train"]["lr"] == 0.03
    rge = load_recipe(p, ["method=szo-rge"])
    assert rge["szo"]["mu"] == 0.25 and rge["train"]["lr"] == 0.03
    assert "method_defaults" not in rge  # the resolved config is complete without it
    assert load_recipe(p, ["method=szo-rge", "train.lr=0.5"])["train"]["lr"] == 0.5
    p.write_text("extends: digits-scratch\nname: m\nmethod_defaults: {szo-xyz: {train: {lr: 1}}}\n")
    with pytest.raises(ValueError, match="unknown method 'szo-xyz'; valid: bp, bp-subspace"):
        load_recipe(p)


def test_streaming_options():
    c = load_recipe("digits-scratch")
    assert c["szo"]["time_chunk"] is None and c["szo"]["stream_bn"] == "exact"  # multi-step by default
    c = load_recipe("digits-scratch", ["szo.time_chunk=1", "szo.stream_bn=running", "method=zo-rge"])
    assert c["szo"]["time_chunk"] == 1 and c["szo"]["stream_bn"] == "running"
    with pytest.raises(ValueError, match="forward-only methods; method 'bp-subspace' backpropagates; "
                                         "valid methods with szo.time_chunk: szo-cge, szo-rge, szo-1pt, szo-cge-1pt, zo-cge"):
        load_recipe("digits-scratch", ["szo.time_chunk=1", "method=bp-subspace"])


def test_compile_option():
    # off in every shipped recipe until a GPU run has checked the compiled path (docs/performance.md)
    assert [load_recipe(r)["compile"] for r in ("cifar10-scratch", "cifar100-continual", "imagenet-bp",
                                                "dvs-gesture-scratch", "digits-scratch", "digits-bp",
                                                "cifar10c-tta")] == [False] * 7
    assert load_recipe("digits-scratch", ["compile=true"])["compile"] is True
    assert load_recipe("digits-bp", ["compile=aot_eager"])["compile"] == "aot_eager"
    with pytest.raises(ValueError, match="unknown torch.compile backend 'fast'; valid: .*inductor"):
        load_recipe("digits-scratch", ["compile=fast"])
    with pytest.raises(ValueError, match="'compile' must be bool/str"):
        load_recipe("digits-scratch", ["compile=1"])
    for extra, what in ((["szo.engine=batched"], "szo.engine 'batched'"), (["szo.time_chunk=1"], "szo.time_chunk"),
                        (["backend=fixed", "bn_stats=deployed"], "backend 'fixed'")):
        with pytest.raises(ValueError, match=f"(compile=True .*cannot be combined with {what}|{what} .*cannot be "
                                             f"combined with compile=True)"):
            load_recipe("digits-scratch", ["compile=true"] + extra)


def test_method_specific_options_rejected_before_anything_runs():
    # each combination used to pass validation and fail only when the optimizer was built,
    # i.e. after a recipe's BPTT stage had already run
    with pytest.raises(ValueError, match="szo.engine 'batched' evaluates SZO probe plans: it applies to methods "
                                         "'szo-cge', 'szo-rge', 'szo-1pt', 'szo-cge-1pt'; method 'bp-subspace' runs with szo.engine 'loop'"):
        load_recipe("digits-scratch", ["method=bp-subspace", "szo.engine=batched"])
    with pytest.raises(ValueError, match="it applies to methods 'szo-cge', 'szo-rge', 'szo-1pt', 'szo-cge-1pt'; method 'zo-cge'"):
        load_recipe("digits-scratch", ["method=zo-cge", "szo.engine=batched"])
    with pytest.raises(ValueError, match="'szo.chunk' .* applies to szo.engine 'batched'"):
        load_recipe("digits-scratch", ["szo.chunk=4"])
    with pytest.raises(ValueError, match="applies to forward-only methods"):
        load_recipe("digits-scratch", ["method=bp", "szo.time_chunk=1"])
    # a BPTT recipe has no SZO stage: its method / szo options are not in play
    assert load_recipe("digits-bp", ["method=bp-subspace", "szo.time_chunk=1"])["kind"] == "bp"


def test_method_table_is_shared():
    import szo.config as C
    import szo.optim as O
    from szo import methods as M

    assert C.METHODS is O.METHODS is M.METHODS
    assert O.SUBSPACE_METHODS is M.SUBSPACE_METHODS
    # every recipe method has its record and an optimizer builder (float or the integer learner's)
    for name in M.list_methods():
        spec = M.get_method(name)
        assert spec.builder(integer=spec.integer) is not None, name
        assert M.method_label(name) == spec.label
    assert set(M.TTA_METHODS) - set(M.METHODS) == {"none", "bn", "tent"}  # adaptation-only records
    with pytest.raises(ValueError, match="unknown method 'sgd'; valid: bp, bp-subspace"):
        M.get_method("sgd", trainable=True)


def _extends(name: str, base: str) -> bool:
    """Recipe ``name`` is ``base`` or extends it (directly or through others)."""
    from szo.config import recipe_path

    while name is not None:
        if name == base:
            return True
        name = yaml.safe_load(recipe_path(name).read_text(encoding="utf-8")).get("extends")
    return False


def _float_subspace_recipes() -> list[str]:
    """The subspace recipes any float method runs in (not the fixed-point ones: digits-fixed, and
    digits-c-mcu, seed 004's integer learner)."""
    from szo.recipes import read_recipe

    return [n for n in recipe_names() if read_recipe(n).get("kind") == "subspace"
            and read_recipe(n).get("backend", "float") == "float" and not _extends(n, "digits-fixed")]


def test_new_methods_resolve_in_every_subspace_recipe():
    subspace = _float_subspace_recipes()
    assert "digits-scratch" in subspace and "imagenet-continual" in subspace and "digits-c-mcu" not in subspace
    for name in subspace:
        for method, lr in (("fg", 1e-3), ("tt-zo", 1e-3), ("fg-subspace", 1.0)):
            cfg = load_recipe(name, [f"method={method}"])
            assert cfg["method"] == method
            if not _extends(name, "digits-scratch"):  # digits-scratch overrides them (method_defaults)
                assert cfg["train"]["lr"] == lr, (name, method)


def test_layerwise_methods_and_sparse_layers():
    c = load_recipe("digits-scratch", ["method=np-zo", "szo.layers=[fc]"])
    assert c["method"] == "np-zo" and c["szo"]["layers"] == ["fc"]
    with pytest.raises(ValueError, match="szo.layers"):
        load_recipe("digits-scratch", ["method=szo-cge", "szo.layers=[fc]"])
    with pytest.raises(ValueError, match="unknown|invalid|valid"):
        load_recipe("digits-scratch", ["method=np_zo"])


_SET = {"coords_per_step": "3", "layers": "[fc]", "stages": "2", "node_losses": "batch-mean", "refresh": "5", "rank": "4"}


@pytest.mark.parametrize("method", list_methods())
def test_one_rule_for_method_options_a_method_does_not_use(method):
    """Every method-specific szo.* option set for a method that does not read it is refused the same
    way (szo.coords_per_step with szo-cge was silently ignored while szo.layers / szo.stages were refused)."""
    from szo.methods import METHOD_OPTIONS, get_method

    assert set(_SET) == set(METHOD_OPTIONS)
    spec = get_method(method)
    base = [f"method={method}", "train.momentum=0", "train.weight_decay=0"]
    for key, value in _SET.items():
        if key in spec.options:
            continue
        with pytest.raises(ValueError, match=rf"^'szo\.{key}' \(.*\) applies to methods? .*; method '{method}' "
                                             rf"does not use it: leave szo\.{key} "):
            load_recipe("digits-scratch", [*base, f"szo.{key}={value}"])


def test_coords_per_step_refused_where_ignored():
    c = load_recipe("digits-scratch", ["method=zo-cge", "szo.coords_per_step=5"])
    assert c["szo"]["coords_per_step"] == 5
    with pytest.raises(ValueError, match="'szo.coords_per_step' .* applies to methods 'zo-cge', 'tt-zo'; "
                                         "method 'szo-cge' does not use it"):
        load_recipe("digits-scratch", ["method=szo-cge", "szo.coords_per_step=5"])
    import torch.nn as nn

    from szo.optim import build_optimizer

    with pytest.raises(ValueError, match="'coords_per_step' .* method 'fg' does not use it"):
        build_optimizer("fg", nn.Linear(2, 2), lr=0.1, coords_per_step=3)


def test_asyncfgd_method_options():
    c = load_recipe("digits-scratch", ["method=asyncfgd"])  # method_defaults: K = 2, plain SGD
    assert c["szo"]["stages"] == 2 and c["train"]["momentum"] == 0.0 and c["train"]["lr"] == 0.01
    for name in _float_subspace_recipes():  # every subspace recipe, given plain SGD
        cfg = load_recipe(name, ["method=asyncfgd", "train.momentum=0"])
        assert cfg["method"] == "asyncfgd" and cfg["szo"]["stages"] in (None, 2)
    with pytest.raises(ValueError, match="'asyncfgd' takes no momentum .* set train.momentum=0"):
        load_recipe("cifar10-scratch", ["method=asyncfgd"])
    with pytest.raises(ValueError, match="'szo.stages' .* applies to methods 'asyncfgd', 'asyncfgd-adam'; method 'fg'"):
        load_recipe("digits-scratch", ["method=fg", "szo.stages=2"])
    with pytest.raises(ValueError, match="'szo.stages' must be >= 1, got 0"):
        load_recipe("digits-scratch", ["method=asyncfgd", "szo.stages=0"])


def test_memory_format_reaches_the_model():
    from szo.build import build_model

    assert build_model(load_recipe("digits-scratch")).memory_format == "auto"
    m = build_model(load_recipe("digits-scratch", ["model.memory_format=channels_last"]))
    assert m.memory_format == "channels_last"


@pytest.mark.parametrize("rule,sets,kw", [
    ("uses no weight decay", ["method=szo-cge", "train.weight_decay=0.1"], dict(weight_decay=0.1)),
    ("takes no momentum", ["method=asyncfgd", "train.momentum=0.9", "szo.stages=2"], dict(momentum=0.9, stages=2)),
    ("evaluates SZO probe plans", ["method=bp-subspace", "szo.engine=batched"], dict(engine="batched")),
])
def test_a_capability_rule_has_one_home_and_one_message(rule, sets, kw):
    """The registry's record says what a method takes (MethodSpec.check_capabilities); config
    validation and build_optimizer ask it, so both give the same message (keys spelled their way)."""
    import re

    import torch

    from szo.models import create
    from szo.optim import build_optimizer

    with pytest.raises(ValueError, match=rule) as recipe_err:
        load_recipe("digits-scratch", sets)
    method = sets[0].split("=")[1]
    model = create("spike_convnet", num_classes=10, T=2, width=2)
    sub = type("S", (), {"basis": torch.eye(model.num_params(), 2), "layout": model.param_layout(),
                         "reference": model.flat_params()})()
    with pytest.raises(ValueError, match=rule) as build_err:
        build_optimizer(method, model, subspace=sub, lr=0.1, **{"momentum": 0.0, **kw})
    unprefixed = re.sub(r"\b(train|szo)\.", "", str(recipe_err.value))
    assert unprefixed == str(build_err.value)


def test_optimizer_options_are_the_recipe_sections():
    """A new SZO hyperparameter is a field of SZOConfig and its use: OptimizerOptions derives from the
    szo section and the update keys of a stage (no field declared twice), optimizer_options carries
    the sections whole, TTOptions is the tt section, the integer learner's widths are the hw section's,
    and a value set in the recipe arrives. A keyword build_optimizer gets is checked by the same rule
    as the recipe key; a model-side key is refused there."""
    import dataclasses

    from szo.config import IntegerStateConfig, StepConfig, SZOConfig, TTConfig
    from szo.models import create
    from szo.optim import IntegerLearnerOptions, OptimizerOptions, TTOptions, build_optimizer
    from szo.prepare import optimizer_options

    assert issubclass(OptimizerOptions, SZOConfig) and issubclass(OptimizerOptions, StepConfig)
    assert issubclass(IntegerLearnerOptions, IntegerStateConfig)
    own = set(OptimizerOptions.__annotations__)  # declared in OptimizerOptions itself
    assert own == {"tt", "integer"}, own
    assert {f.name for f in dataclasses.fields(SZOConfig)} <= {f.name for f in dataclasses.fields(OptimizerOptions)}
    assert TTOptions is TTConfig  # the tt section itself, not a copy of its fields
    o = optimizer_options(load_recipe("digits-scratch", ["method=np-zo", "szo.layers=[conv1]", "szo.q=7",
                                                         "szo.node_losses=batch-mean", "train.momentum=0.5",
                                                         "szo.scale=absolute", "tt.sign_q=3"]))
    assert (o.layers, o.q, o.node_losses, o.momentum, o.scale, o.tt.sign_q) == (
        ["conv1"], 7, "batch-mean", 0.5, "absolute", 3)
    i = optimizer_options(load_recipe("digits-fixed", ["hw.learner=integer", "hw.coord_bits=24", "seed=5"])).integer
    assert (i.coord_bits, i.seed) == (24, 6)
    model = create("spike_convnet", num_classes=10, T=2, width=2)
    for bad, recipe_key in ((dict(q=0), "szo.q=0"), (dict(engine="fast"), "szo.engine=fast")):
        with pytest.raises(ValueError) as recipe_err:
            load_recipe("digits-scratch", [recipe_key])
        with pytest.raises(ValueError) as build_err:
            build_optimizer("szo-cge", model, subspace=None, lr=0.1, **bad)
        assert str(build_err.value) == str(recipe_err.value).replace("szo.", "")  # one rule, spelled per caller
    with pytest.raises(ValueError, match="time_chunk: a setting of the model"):
        build_optimizer("szo-cge", model, lr=0.1, time_chunk=2)


def test_sections_built_from_python_take_tuples_and_paths():
    """A section built from Python (run_tta's keywords, build_optimizer's) takes a tuple where the
    schema says list and a path where it says str, as the records it replaced did."""
    from pathlib import Path

    from szo.config import TTAConfig
    from szo.optim import OptimizerOptions

    t = TTAConfig(corruptions=("gaussian_noise", "fog"), data_dir=Path("/data/c"))
    assert t.corruptions == ["gaussian_noise", "fog"] and t.data_dir == "/data/c"
    assert OptimizerOptions(lr=0.1, layers=("conv1",)).layers == ["conv1"]
    with pytest.raises(ValueError, match="'corruptions' must be list"):
        TTAConfig(corruptions="fog")


def test_refresh_is_a_setting_of_the_float_szo_training_stage():
    c = load_recipe("digits-scratch", ["szo.refresh=10"])
    assert c["szo"]["refresh"] == 10 and load_recipe("digits-scratch")["szo"]["refresh"] is None
    with pytest.raises(ValueError, match="szo.refresh"):
        load_recipe("digits-scratch", ["szo.refresh=0"])
    with pytest.raises(ValueError, match=r"^szo.refresh \(a redrawn random basis\) is a setting of the float SZO; "
                                         "the integer on-chip learner"):
        load_recipe("digits-fixed", ["hw.learner=integer", "szo.refresh=10"])
    with pytest.raises(ValueError, match=r"^szo.refresh \(a redrawn random basis\) applies to the training stage"):
        load_recipe("digits-c-tta", ["szo.refresh=10"])


@pytest.mark.parametrize("key, value", [("szo.mu", "1e39"), ("szo.mu", "1e308"), ("train.lr", "-1e39"),
                                        ("federated.sigma", "3.5e38")])
def test_a_float_setting_must_be_finite_in_float32(key, value):
    """Finite in float64 is not finite in the float32 the probes and updates run in: mu = 1e39 once passed
    the schema and ended in a traceback at the first probe. One line, at every door (recipe, build_optimizer)."""
    import torch

    from szo.optim import build_optimizer

    with pytest.raises(ValueError, match=rf"^'{key}' must be finite in float32, the arithmetic runs in it "
                                         r"\(\|value\| <= 3.403e\+38\), got "):
        load_recipe("digits-scratch", [f"{key}={value}", "method=szo-rge"])
    with pytest.raises(ValueError, match=r"^'mu' must be finite in float32"):
        build_optimizer("zo-rge", torch.nn.Linear(2, 2), mu=1e39)
    assert load_recipe("digits-scratch", ["szo.mu=3e38"]).szo.mu == 3e38  # the largest float32 is allowed


@pytest.mark.parametrize("key, value", [("szo.mu", "1e-50"), ("train.lr", "1e-50"), ("train.lr", "1e-39"),
                                        ("federated.sigma", "-1e-45"), ("tta.lr_reset", "1e-40")])
def test_a_float_setting_must_not_round_to_zero_in_float32(key, value):
    """Issue 49: ``--set szo.scale=absolute --set szo.mu=1e-50`` or ``--set train.lr=1e-50`` completed at
    chance: 0 or subnormal in float32. One line naming the setting, at every door (recipe / --set,
    build_optimizer, the optimizers' constructors); 0 itself stays a value where the setting allows it."""
    import torch

    from szo.optim import SZO, build_optimizer

    with pytest.raises(ValueError, match=rf"^'{key}' is 0 or subnormal in float32, the arithmetic runs in it "
                                         r"\(0 or \|value\| >= 1.175e-38\), got "):
        load_recipe("digits-c-tta" if key.startswith("tta.") else "digits-scratch",
                    [f"{key}={value}", "szo.scale=absolute"])
    model = torch.nn.Linear(2, 2)
    for kw in ("mu", "lr"):
        with pytest.raises(ValueError, match=rf"^'{kw}' is 0 or subnormal in float32"):
            build_optimizer("zo-rge", model, **{kw: 1e-50})
    sub = type("Sub", (), {"basis": torch.eye(6)[:, :2], "layout": None, "reference": torch.zeros(6),
                           "eigenvalues": torch.ones(2)})()
    for kw in ("mu", "lr"):
        with pytest.raises(ValueError, match=rf"^'{kw}' is 0 or subnormal in float32"):
            SZO(model, sub, **{kw: 1e-40})
        with pytest.raises(ValueError, match=rf"^'{kw}' must be finite in float32"):
            SZO(model, sub, **{kw: 1e39})
    assert load_recipe("digits-scratch", ["train.lr=0", "szo.mu=1.2e-38"]).train.lr == 0.0


@pytest.mark.parametrize("item", ["szo.mu=", "szo.mu=  ", "train.lr="])
def test_an_empty_value_is_refused(item):
    """Issue 49: ``--set szo.mu=`` became the default and a full training started."""
    key = item.split("=")[0]
    with pytest.raises(ValueError, match=rf"^--set {key}= has no value; give one \(e.g. {key}=VALUE\), or "
                                         rf"{key}=null for the default$"):
        load_recipe("digits-scratch", [item])
    assert load_recipe("digits-scratch", [f"{key}=null"]) == load_recipe("digits-scratch")
