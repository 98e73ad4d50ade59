"""End to end on digits with a tiny model: BPTT + trajectory -> subspace -> SZO / continual."""
import json

import pytest
import torch
import yaml

from szo.build import subspace_store_for
from szo.config import load_recipe
from szo.pipeline import build_store_subspace, run_recipe
from szo.report import collect_runs, render

TINY = ["model.T=2", "model.kwargs={width: 4}", "progress=false", "data.batch_size=32", "data.test_batch_size=120"]


@pytest.fixture(scope="module")
def bp_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipe")
    sets = TINY + [f"subspace.root={root / 'subspaces'}", "bptt.epochs=2", "bptt.max_steps_per_epoch=6",
                   "trajectory.every=1", "subspace.k=6", "bptt.lr=0.5"]
    cfg = load_recipe("digits-bp", sets)
    s = run_recipe(cfg, root / "bp")
    return root, sets, s


def test_bptt_stage_outputs(bp_run):
    root, sets, s = bp_run
    d = root / "bp"
    for f in ("config.yaml", "metrics.jsonl", "results.json", "training_curve.png", "model.safetensors",
              "checkpoints/last.pt", "trajectory/manifest.json"):
        assert (d / f).exists(), f
    assert yaml.safe_load((d / "config.yaml").read_text())["bptt"]["epochs"] == 2
    assert s["fp"] == s["bp"] == 12 and s["mode"] == "bptt" and s["label"] == "BP"
    man = json.loads((d / "trajectory" / "manifest.json").read_text())
    assert len(man["samples"]) == 13  # initial + every step
    sub = subspace_store_for(load_recipe("digits-bp", sets)).load("digits-convnet-k20")
    assert sub.k == 6 and sub.provenance["source_model"] == str((d / "model.safetensors").resolve())
    # a second fresh BPTT run must not silently replace the stored subspace
    with pytest.raises(ValueError, match="already exists"):
        run_recipe(load_recipe("digits-bp", sets), root / "bp2")


def test_scratch_szo_cge_in_subspace(bp_run):
    root, sets, _ = bp_run
    cfg = load_recipe("digits-scratch", sets + ["train.epochs=2", "train.max_steps_per_epoch=4", "method=szo-cge"])
    s = run_recipe(cfg, root / "cge")
    # 2k probes + the unperturbed BN forward (bn_update=recompute) per step
    assert s["fp"] == 2 * 4 * (2 * 6 + 1) and s["bp"] == 0 and s["k"] == 6 and s["label"] == "SZO-CGE"
    # the recipe's default scale for SZO-CGE, as the optimizer reports it (szo.zo.ReportsResults): one unit,
    # the trajectory's spread, for each of the k directions, and the first steps' gradient length
    assert s["scale"]["rule"] == "trajectory" and len(set(s["scale"]["units"])) == 1 and len(s["scale"]["units"]) == 6
    assert s["scale"]["gradient_unit"] > 0
    assert not (root / "cge" / "bptt").exists()  # the subspace was in the store already
    # the model started at the reference and moved only inside the subspace
    ck = torch.load(root / "cge" / "checkpoints" / "last.pt", weights_only=True)
    from szo.build import build_model

    m = build_model(cfg)
    m.load_state_dict(ck["model"])
    sub = subspace_store_for(cfg).load("digits-convnet-k20")
    delta = m.flat_params().double() - sub.reference.double()
    resid = delta - sub.basis.double() @ (sub.basis.double().T @ delta)
    assert delta.norm() > 0 and resid.norm() < 1e-4 * delta.norm() + 1e-5


def test_streaming_szo_run_equals_multistep_run(bp_run):
    """szo.time_chunk=1 with stream_bn=exact trains the same model as the multi-step forward."""
    root, sets, _ = bp_run
    base = sets + ["train.epochs=1", "train.max_steps_per_epoch=2", "method=szo-cge"]
    states = []
    for extra, d in (([], "ms"), (["szo.time_chunk=1", "szo.stream_bn=exact"], "stream")):
        s = run_recipe(load_recipe("digits-scratch", base + extra), root / d)
        states.append((s, torch.load(root / d / "checkpoints" / "last.pt", weights_only=True)["model"]))
    (s0, m0), (s1, m1) = states
    assert s1["fp"] == s0["fp"] and s1["best_test_acc"] == s0["best_test_acc"]
    for k in m0:
        torch.testing.assert_close(m1[k], m0[k], rtol=1e-5, atol=1e-6, msg=k)
    assert yaml.safe_load((root / "stream" / "config.yaml").read_text())["szo"]["time_chunk"] == 1


def test_continual_and_rge_and_report(bp_run):
    root, sets, _ = bp_run
    cont = load_recipe("digits-continual", sets + ["subspace.window=1-2", "subspace.k=4", "train.epochs=1",
                                                   "train.max_steps_per_epoch=3"])
    build_store_subspace(cont, root / "bp", progress=False)
    s = run_recipe(cont, root / "cont")
    assert s["mode"] == "continual" and s["fp"] == 3 * (2 * 4 + 1)
    rge = load_recipe("digits-scratch", sets + ["method=szo-rge", "szo.q=2", "train.epochs=1",
                                                "train.max_steps_per_epoch=3", "szo.scale=trajectory"])
    s = run_recipe(rge, root / "rge")
    assert s["fp"] == 3 * (2 * 2 + 1) and s["label"] == "SZO-RGE(q=2)"
    sc = s["scale"]  # units of the k = 6 subspace; the gradient unit from the first ceil(k / q) = 3 steps
    assert sc["rule"] == "trajectory" and len(sc["units"]) == 6 and sc["calibration_steps"] == 3
    assert sc["gradient_unit"] > 0
    md = render(collect_runs([root]))
    assert "SZO-RGE(q=2)" in md and "| digits | spike_convnet |" in md


def test_subspace_recipe_runs_missing_bptt_stage(tmp_path):
    sets = TINY + [f"subspace.root={tmp_path / 'subspaces'}", "bptt.epochs=1", "bptt.max_steps_per_epoch=5",
                   "trajectory.every=1", "subspace.k=3", "train.epochs=1", "train.max_steps_per_epoch=2",
                   "method=bp-subspace"]
    s = run_recipe(load_recipe("digits-scratch", sets), tmp_path / "run")
    assert (tmp_path / "run" / "bptt" / "model.safetensors").is_file()
    assert s["fp"] == s["bp"] == 2 and s["label"] == "BP-Subspace"


def test_fixed_backend_recipe_converts_and_trains_through_integer_forward(bp_run):
    root, sets, _ = bp_run
    small = sets + ["train.epochs=1", "train.max_steps_per_epoch=2"]
    s = run_recipe(load_recipe("digits-fixed", small), root / "fixed")
    conv = s["conversion"]
    assert s["backend"] == "fixed" and s["bn_stats"] == "deployed" and s["fp"] == 2 * 2 * 6
    assert 0.0 <= conv["fixed_test_acc"] <= 1.0 and 0.0 <= conv["float_test_acc"] <= 1.0
    assert 0.0 < s["basis_rel_error"] < 0.02  # int8 basis, per-column scale
    assert isinstance(s["saturations_total"], int)
    assert json.loads((root / "fixed" / "results.json").read_text())["saturations_total"] == s["saturations_total"]
    # deployed BN statistics: the run never changes the BN buffers of the pretrained model
    ck = torch.load(root / "fixed" / "checkpoints" / "last.pt", weights_only=True)
    from safetensors.torch import load_file

    src = load_file(root / "bp" / "model.safetensors")
    for n in ("bn1.running_mean", "bn2.running_var"):
        assert torch.equal(ck["model"][n], src[n])
    # the integer on-chip learner (XORShift32 Rademacher probes) through the same recipe
    s = run_recipe(load_recipe("digits-fixed", small + ["method=szo-rge", "szo.q=2", "hw.learner=integer"]),
                   root / "fixed-int")
    assert s["fp"] == 2 * 2 * 2 and s["label"] == "SZO-RGE(q=2)"
    ck = torch.load(root / "fixed-int" / "checkpoints" / "last.pt", weights_only=True)
    assert ck["optimizer"]["on_chip"]["c"].dtype == torch.int64
    # both arithmetics reported at conversion; training through the Lava-exact one with hard reset
    assert set(conv["arithmetics"]) == {"szo, reset=own", "szo, reset=zero", "loihi, reset=own", "loihi, reset=zero"}
    assert conv["fixed_test_acc"] == conv["arithmetics"]["szo, reset=own"]["test_acc"]
    s = run_recipe(load_recipe("digits-fixed", small + ["hw.arithmetic=loihi", "hw.reset=zero"]), root / "fixed-loihi")
    assert (s["hw"]["arithmetic"], s["hw"]["reset"]) == ("loihi", "zero") and s["fp"] == 2 * 2 * 6
    assert s["conversion"]["fixed_test_acc"] == s["conversion"]["arithmetics"]["loihi, reset=zero"]["test_acc"]


def test_fixed_backend_bad_combinations_are_one_clear_error():
    with pytest.raises(ValueError, match="needs bn_stats 'deployed'"):
        load_recipe("digits-fixed", ["bn_stats=batch"])
    with pytest.raises(ValueError, match="valid: szo-cge, szo-rge, szo-1pt"):
        load_recipe("digits-fixed", ["method=bp-subspace"])
    with pytest.raises(ValueError, match="needs backend 'fixed'"):
        load_recipe("digits-scratch", ["hw.learner=integer"])
    with pytest.raises(ValueError, match="invalid backend 'loihi'; valid: float, fixed"):
        load_recipe("digits-scratch", ["backend=loihi"])
    with pytest.raises(ValueError, match="invalid hw.arithmetic 'lava'; valid: szo, loihi"):
        load_recipe("digits-fixed", ["hw.arithmetic=lava"])
    with pytest.raises(ValueError, match="invalid hw.reset 'hard'; valid: subtract, zero"):
        load_recipe("digits-fixed", ["hw.reset=hard"])
    with pytest.raises(ValueError, match="with backend 'float' leave them at 'szo' / null"):
        load_recipe("digits-fixed", ["backend=float", "hw.arithmetic=loihi"])


def test_config_hw_choices_are_the_backends():
    from szo import config
    from szo.hw.fixed import ARITHMETICS
    from szo.hw.neuron import RESETS

    assert config.HW_ARITHMETICS == ARITHMETICS and config.HW_RESETS == RESETS


def test_event_frame_recipe_batches_are_time_major(tmp_path):
    # event-frame samples are [T, P, H, W]; the loader must hand the model [T, N, P, H, W]
    from szo.data import collate_time_major

    x, y = collate_time_major([(torch.zeros(5, 2, 4, 4), 1), (torch.ones(5, 2, 4, 4), 2)])
    assert x.shape == (5, 2, 2, 4, 4) and torch.equal(x[:, 1], torch.ones(5, 2, 4, 4)) and y.tolist() == [1, 2]
    x, _ = collate_time_major([(torch.zeros(1, 8, 8), 0)] * 3)
    assert x.shape == (3, 1, 8, 8)
    sets = ["progress=false", "model.T=4", "model.kwargs={width: 4}", "data.kwargs={T: 4, n_per_class: 2}",
            "data.test_batch_size=22", "bptt.epochs=1", "trajectory.every=1", "subspace.k=1",
            f"subspace.root={tmp_path / 'subspaces'}"]
    s = run_recipe(load_recipe("synthetic-gesture", sets), tmp_path / "sg")
    assert s["fp"] == s["bp"] == 2 and s["best_test_acc"] is not None


def test_batched_engine_recipe_equals_loop(bp_run):
    root, sets, _ = bp_run
    small = sets + ["train.epochs=1", "train.max_steps_per_epoch=3", "method=szo-cge"]
    loop = run_recipe(load_recipe("digits-scratch", small), root / "eng-loop")
    bat = run_recipe(load_recipe("digits-scratch", small + ["szo.engine=batched", "szo.chunk=4"]), root / "eng-bat")
    assert bat["fp"] == loop["fp"] == 3 * (2 * 6 + 1)
    assert abs(bat["best_test_acc"] - loop["best_test_acc"]) < 1e-9
    hist = [json.loads(line) for line in (root / "eng-bat" / "metrics.jsonl").read_text().splitlines()]
    # the engine returns probe losses only; train accuracy comes from the unperturbed BN forward
    loop_hist = [json.loads(line) for line in (root / "eng-loop" / "metrics.jsonl").read_text().splitlines()]
    assert hist[-1]["train_acc"] is not None and hist[-1]["train_acc"] == loop_hist[-1]["train_acc"]


def test_compiled_recipe_equals_eager(bp_run):
    # compile=aot_eager: the same dynamo capture as inductor (tests/models/test_compiled.py
    # checks inductor itself) without minutes of code generation in the suite
    import torch._dynamo

    from szo.models.compiled import graph_count

    root, sets, _ = bp_run
    bp = ["subspace.name=null", "bptt.epochs=1", "bptt.max_steps_per_epoch=2", "trajectory.every=1"]
    small = sets + ["train.epochs=1", "train.max_steps_per_epoch=2", "method=szo-rge", "szo.q=2"]
    g0 = graph_count()
    try:
        runs = {(kind, c): run_recipe(load_recipe(f"digits-{kind}", (bp if kind == "bp" else small) + [f"compile={c}"]
                                                  + (sets if kind == "bp" else [])), root / f"compile-{kind}-{c}")
                for kind in ("bp", "scratch") for c in ("false", "aot_eager")}
    finally:
        torch._dynamo.reset()
    assert graph_count() > g0  # the compiled runs did compile
    for kind in ("bp", "scratch"):
        e, c = runs[(kind, "false")], runs[(kind, "aot_eager")]
        assert c["fp"] == e["fp"] and abs(c["best_test_acc"] - e["best_test_acc"]) < 1e-9
        he, hc = ([json.loads(x) for x in (root / f"compile-{kind}-{v}" / "metrics.jsonl").read_text().splitlines()]
                  for v in ("false", "aot_eager"))
        assert hc[-1]["train_loss"] == pytest.approx(he[-1]["train_loss"], rel=1e-5)


def test_compile_with_hook_synchronised_bn_is_refused_before_a_multi_process_run():
    from szo.stages import check_distributed

    cfg = load_recipe("digits-scratch", ["compile=true", "method=szo-cge"])
    with pytest.raises(ValueError, match="distributed.sync_bn with distributed.mode 'data' .* cannot be combined with "
                                         "compile=True"):
        check_distributed(cfg)
    with pytest.raises(ValueError, match="distributed.sync_bn with distributed.mode 'data' .* cannot be combined with "
                                         "cuda_graphs=true"):  # the same rule on a graphed forward
        check_distributed(load_recipe("digits-scratch", ["cuda_graphs=true", "method=szo-cge"]))
    check_distributed(load_recipe("digits-scratch", ["compile=true", "method=szo-cge", "distributed.sync_bn=false"]))


def test_load_run_model_rebuilds_the_run_model(bp_run, tmp_path):
    from szo.build import load_run_model

    root, sets, _ = bp_run
    model, cfg = load_run_model(root / "bp")  # BPTT run: model.safetensors
    assert cfg["model"]["kwargs"] == {"width": 4} and model.T == 2
    from safetensors.torch import load_file

    for k, v in load_file(root / "bp" / "model.safetensors").items():
        assert torch.equal(model.state_dict()[k], v), k
    model, cfg = load_run_model(root / "cge")  # subspace run: checkpoints/last.pt
    ck = torch.load(root / "cge" / "checkpoints" / "last.pt", weights_only=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in ck["model"].items()) and cfg["method"] == "szo-cge"
    with pytest.raises(FileNotFoundError, match="no config.yaml"):
        load_run_model(tmp_path)


def test_mnist5k_recipes_run_tiny(tmp_path):
    """mnist5k-bp -> mnist5k-scratch end to end on a 96-image slice (spike_resnet8, T = 2)."""
    sets = ["model.T=2", "progress=false", "data.batch_size=32", "data.test_batch_size=96", "data.kwargs={limit: 96}",
            "bptt.epochs=1", "trajectory.every=1", "subspace.k=2", f"subspace.root={tmp_path / 'subspaces'}"]
    s = run_recipe(load_recipe("mnist5k-bp", sets), tmp_path / "bp")
    assert s["bp"] == 3 and s["dataset"] == "mnist5k" and s["model"] == "spike_resnet8"
    s = run_recipe(load_recipe("mnist5k-scratch", sets + ["train.epochs=1", "train.max_steps_per_epoch=1"]),
                   tmp_path / "scratch")
    assert s["label"] == "SZO-CGE" and s["bp"] == 0 and s["fp"] >= 4  # 2k probes of one step


@pytest.mark.parametrize("method,extra,fp", [
    ("fg", ["szo.q=2", "train.lr=0.01"], 4 * 2),
    ("fg-subspace", ["szo.q=1", "train.lr=0.05"], 4 * 1),
    ("asyncfgd", ["szo.stages=3", "train.lr=0.01"], 4 * 1),  # one JVP pass per micro-batch
    # 2 signRGE steps of sign_q + 1 = 4 forwards, then 2 CGE steps over 3 coordinates, each step
    # + the unperturbed BN forward of bn_update=recompute. The paper's default (4 cores, one-sided
    # CGE: 3 probes + the base loss) and the 2-core central variant (6 probe forwards)
    ("tt-zo", ["tt.min_params=100", "tt.rank=2", "tt.sign_q=3", "tt.switch_step=2", "szo.coords_per_step=3"],
     2 * (4 + 1) + 2 * (3 + 1 + 1)),
    ("tt-zo", ["tt.min_params=100", "tt.rank=3", "tt.cores=2", "tt.cge=central", "tt.sign_q=3",
               "tt.switch_step=2", "szo.coords_per_step=3"], 2 * (4 + 1) + 2 * (6 + 1)),
])
def test_forward_gradient_and_tt_zo_recipes_count_forwards(bp_run, method, extra, fp):
    root, sets, _ = bp_run
    cfg = load_recipe("digits-scratch", sets + ["train.epochs=1", "train.max_steps_per_epoch=4",
                                                f"method={method}"] + extra)
    s = run_recipe(cfg, root / f"{method}-{len(extra)}")
    assert s["fp"] == fp and s["bp"] == 0 and s["method"] == method
    assert 0.0 <= s["final_test_acc"] <= 1.0
    if method == "tt-zo":
        assert {r["layer"] for r in s["tt"]["layers"]} == {"conv2", "fc"} and s["tt"]["d_tt"] < s["tt"]["d_dense"]
        assert s["tt"]["switched_at_step"] == 2
        from szo.build import load_run_model

        model, _ = load_run_model(root / f"{method}-{len(extra)}")  # rebuilt with the run's TT cores
        assert sum(p.numel() for p in model.parameters()) == s["tt"]["d_tt"]


def test_unknown_method_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"invalid method .sgd.; valid: bp, .*fg, fg-subspace, tt-zo"):
        load_recipe("digits-scratch", ["method=sgd"])


def test_seed004_methods_run_through_the_recipes(bp_run):
    root, sets, _ = bp_run
    small = sets + ["train.epochs=1", "train.max_steps_per_epoch=2"]
    s = run_recipe(load_recipe("digits-fixed", small + ["method=qzo-subspace", "szo.q=3"]), root / "qzo")
    assert s["fp"] == 2 * (1 + 3) and s["bp"] == 0 and s["label"] == "QZO-Subspace(q=3)"
    ck = torch.load(root / "qzo" / "checkpoints" / "last.pt", weights_only=True)
    assert ck["optimizer"]["on_chip"]["c"].dtype == torch.int64
    # seed 004's own learner: int8 weights, 1 + q L forwards per step (3 synapses), resumable
    cfg = load_recipe("digits-fixed", small + ["method=mcu-zo", "szo.q=2", "train.scheduler=constant"])
    s = run_recipe(cfg, root / "mcu")
    assert s["fp"] == 2 * (1 + 2 * 3) and s["bp"] == 0 and s["label"] == "MCU-ZO(q=2)"
    assert s["mcu"]["modes"] == {"conv1": "weight", "conv2": "weight", "fc": "node"}
    ck = torch.load(root / "mcu" / "checkpoints" / "last.pt", weights_only=True)
    ints = ck["optimizer"]["mcu"]["integers"]
    assert all(t.dtype == torch.int64 for t in ints) and -128 <= int(ints[0].min()) <= int(ints[0].max()) <= 127
    more = load_recipe("digits-fixed", sets + ["train.epochs=2", "train.max_steps_per_epoch=2", "method=mcu-zo",
                                               "szo.q=2", "train.scheduler=constant"])
    s2 = run_recipe(more, root / "mcu", resume=True)
    # the checkpoint carries the integer graph and the modes: the resumed run takes the forwards
    # of the uninterrupted one (no clean forward measured again, issue 40 item 17)
    assert s2["fp"] == 2 * 2 * (1 + 2 * 3) and s2["epochs"] == 2
    assert s2["mcu"]["modes"] == s["mcu"]["modes"]
    s = run_recipe(load_recipe("digits-scratch", small + ["method=np-zo", "szo.q=2", "szo.layers=[fc]"]),
                   root / "np")
    # clean forward + q probes of the one layer + the BN forward (bn_update=recompute), per step
    assert s["fp"] == 2 * (1 + 2 * 1 + 1) and s["bp"] == 0 and s["label"] == "NP-ZO(q=2)"


def test_tensorboard_sink_holds_the_metrics_jsonl_values(bp_run):
    """log.tensorboard=true: TensorBoard event files next to metrics.jsonl, same numbers (read back
    with TensorBoard's own event reader); a resumed run purges what the interrupted one wrote after
    its checkpoint."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from szo.train import read_metrics

    root, sets, _ = bp_run
    cfg = load_recipe("digits-scratch", sets + ["train.epochs=2", "train.max_steps_per_epoch=3", "log.tensorboard=true"])
    run_recipe(cfg, root / "tb")
    rows = read_metrics(root / "tb" / "metrics.jsonl")
    acc = EventAccumulator(str(root / "tb" / "tensorboard"))
    acc.Reload()
    for key in ("train_loss", "test_acc", "fp", "lr"):
        events = acc.Scalars(key)
        assert [e.step for e in events] == [r["epoch"] for r in rows], key
        assert [e.value for e in events] == pytest.approx([r[key] for r in rows], rel=1e-6), key  # float32 in events
    assert "train_acc" in acc.Tags()["scalars"] and "epoch" not in acc.Tags()["scalars"]


def test_evaluate_stage_is_the_runs_own_test_accuracy(bp_run):
    from szo.stages import evaluate_stage

    root, _, summary = bp_run
    got = evaluate_stage(root / "bp")
    assert got["samples"] == 360 and got["test_acc"] == pytest.approx(summary["final_test_acc"])


def test_mcu_adaptation_recipe_pretrains_on_clean_data_and_selects_a_block(tmp_path):
    """digits-c-mcu (seed 004's setting): the store entry comes from its source's BPTT stage on clean
    digits (not the corrupted training data it adapts on), then the block selection stage picks one
    block and only that block trains (1 + q per step)."""
    sets = TINY + [f"subspace.root={tmp_path / 'subspaces'}", "bptt.epochs=1", "bptt.max_steps_per_epoch=6",
                   "trajectory.every=1", "subspace.k=3", "subspace.window=null", "szo.q=2", "train.epochs=1",
                   "train.max_steps_per_epoch=2"]
    s = run_recipe(load_recipe("digits-c-mcu", sets), tmp_path / "run")
    bptt = yaml.safe_load((tmp_path / "run" / "bptt" / "config.yaml").read_text())
    assert (bptt["name"], bptt["data"]["name"], bptt["model"]["T"]) == ("digits-continual", "digits", 2)
    sel = s["block_selection"]
    assert sel["blocks"] == [["conv1"], ["conv2"], ["fc"]] and sel["layers"] == sel["blocks"][sel["block"]]
    assert sel == {k: v for k, v in json.loads((tmp_path / "run" / "block_selection.json").read_text()).items()
                   if k in sel}
    assert s["fp"] == 2 * (1 + 2 * len(sel["layers"])) and set(s["mcu"]["modes"]) == set(sel["layers"])
    assert s["dataset"] == "digits-c" and 0.0 <= s["conversion"]["fixed_test_acc"] <= 1.0


def test_mcu_block_selection_run_resumes_exactly(tmp_path):
    """A run stopped after its first epoch and resumed keeps its selected block (block_selection.json)
    and ends with the integers of the uninterrupted run."""
    sets = TINY + [f"subspace.root={tmp_path / 'subspaces'}", "bptt.epochs=1", "bptt.max_steps_per_epoch=6",
                   "trajectory.every=1", "subspace.k=3", "subspace.window=null", "szo.q=2",
                   "train.max_steps_per_epoch=2", "train.scheduler=constant", "hw.heldout=0.5"]
    whole = run_recipe(load_recipe("digits-c-mcu", sets + ["train.epochs=2"]), tmp_path / "whole")
    run_recipe(load_recipe("digits-c-mcu", sets + ["train.epochs=1"]), tmp_path / "part")
    resumed = run_recipe(load_recipe("digits-c-mcu", sets + ["train.epochs=2"]), tmp_path / "part", resume=True)
    assert resumed["block_selection"] == whole["block_selection"]
    a, b = (torch.load(tmp_path / d / "checkpoints" / "last.pt", weights_only=True)["optimizer"]["mcu"]["integers"]
            for d in ("whole", "part"))
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_the_model_is_built_once_per_model_a_run_trains(tmp_path, monkeypatch):
    """preflight builds the recipe's model to check it, and the first stage trains that one: a BP run
    builds one model, a subspace run that needs its BPTT stage two (the BPTT model and the subspace
    stage's), a subspace run on a stored subspace one."""
    import szo.prepare as prepare
    import szo.stages as stages

    built = []
    real = stages.build_model
    for where in (stages, prepare):  # the stages build the models they train, szo.prepare preflight's and the subspace's
        monkeypatch.setattr(where, "build_model", lambda cfg: built.append(cfg.kind) or real(cfg))
    sets = TINY + [f"subspace.root={tmp_path / 'store'}", "bptt.epochs=1", "bptt.max_steps_per_epoch=2",
                   "trajectory.every=1", "subspace.k=2", "train.epochs=1", "train.max_steps_per_epoch=1"]
    assert run_recipe(load_recipe("digits-bp", sets + ["subspace.name=bp-only"]), tmp_path / "bp")["status"] == "completed"
    assert built == ["bp"]
    built.clear()
    assert run_recipe(load_recipe("digits-scratch", sets), tmp_path / "s1")["status"] == "completed"
    assert built == ["subspace", "subspace"]  # preflight's (trained by BPTT) + the subspace stage's
    built.clear()
    assert run_recipe(load_recipe("digits-scratch", sets), tmp_path / "s2")["status"] == "completed"
    assert built == ["subspace"]
