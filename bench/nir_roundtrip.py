"""NIR round-trip error of a trained run: szo -> .nir -> (szo import | snnTorch), and the fixed-point export.

    OMP_NUM_THREADS=1 python bench/nir_roundtrip.py RUN_DIR [--out bench/results/nir_roundtrip.json]

On the run's whole test set: the largest logit difference and the prediction agreement of the
imported networks against szo's own forward (float32, and float64 for the szo import), the
spike agreement per layer and the share of samples hit by snnTorch 1.0's late subtractive
reset (see szo.export.simulators), snnTorch with that reset term dropped (a diagnostic), and the fixed-point network against its exported float
equivalent. Prints a markdown table; writes JSON with --out.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from common import RESULTS, set_threads  # noqa: F401  (puts the checkout on sys.path)

from szo.build import load_run_model
from szo.data import get_dataset, make_loader
from szo.export import from_nir, read_nir, to_nir, write_nir
from szo.export.simulators import run_snntorch, snntorch_from_nir
from szo.hw.convert import to_fixed
from szo.io import atomic_write_json


def _spikes(model: torch.nn.Module, kinds: tuple[type, ...]) -> tuple[list, list]:
    rec: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda m, i, o: rec.append(o[0] if isinstance(o, tuple) else o))
             for m in model.modules() if isinstance(m, kinds)]
    return rec, hooks


@torch.no_grad()
def main() -> None:
    import snntorch as snn
    from spikingjelly.activation_based import neuron

    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    set_threads(1)
    model, cfg = load_run_model(args.run_dir)
    model.eval()
    ds = get_dataset(cfg["data"]["name"], "test")
    x, y = next(iter(make_loader(ds, len(ds), shuffle=False)))
    shape = tuple(x.shape[-3:])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.nir"
        write_nir(to_nir(model, shape), path)
        graph = read_nir(path)
        fpath = Path(tmp) / "f.nir"
        fixed = to_fixed(model)
        write_nir(to_nir(fixed, shape), fpath)
        fback = from_nir(fpath).eval()
    back = from_nir(graph).eval()
    rec_ref, h1 = _spikes(model, (neuron.LIFNode,))
    ref = model(x)
    for h in h1:
        h.remove()
    imp = back(x)
    imp64 = from_nir(graph).double().eval()(x.double())
    ref64 = load_run_model(args.run_dir)[0].double().eval()(x.double())
    net = snntorch_from_nir(graph)
    rec_snn, h2 = _spikes(net, (snn.Leaky,))
    seq = x.unsqueeze(0).repeat(model.T, 1, 1, 1, 1) if x.dim() == 4 else x
    run = run_snntorch(net, seq)
    for h in h2:
        h.remove()
    n_layers = len(rec_ref)
    spike_agree = []
    for li in range(n_layers):  # snnTorch records [1, ...] per (sample, step), sample-major
        theirs = torch.stack(rec_snn[li::n_layers]).view(x.shape[0], model.T, *rec_ref[li].shape[2:])
        spike_agree.append(float((theirs.transpose(0, 1) == rec_ref[li]).float().mean()))
    patched = run_snntorch(snntorch_from_nir(graph, patch_late_reset=True), seq)
    fx_out = fixed(x)
    fb_out = fback(x)

    def pred(o):
        return o.mean(0).argmax(-1)

    res = {
        "run_dir": str(args.run_dir), "samples": int(x.shape[0]), "T": model.T,
        "accuracy": {"szo": float((pred(ref) == y).float().mean()), "szo_import": float((pred(imp) == y).float().mean()),
                     "snntorch": float((pred(run.logits) == y).float().mean()),
                     "fixed": float((pred(fx_out) == y).float().mean()),
                     "fixed_nir_import": float((pred(fb_out) == y).float().mean())},
        "szo_import": {"max_abs_logit_diff_f32": float((ref - imp).abs().max()),
                       "max_abs_logit_diff_f64": float((ref64 - imp64).abs().max()),
                       "pred_agreement": float((pred(ref) == pred(imp)).float().mean())},
        "snntorch": {"max_abs_logit_diff": float((ref - run.logits).abs().max()),
                     "pred_agreement": float((pred(ref) == pred(run.logits)).float().mean()),
                     "spike_agreement_per_layer": spike_agree,
                     "samples_with_late_reset": float(run.late_reset.float().mean())},
        "snntorch_late_reset_patched": {
            "max_abs_logit_diff": float((ref - patched.logits).abs().max()),
            "pred_agreement": float((pred(ref) == pred(patched.logits)).float().mean()),
            "accuracy": float((pred(patched.logits) == y).float().mean())},
        "fixed_vs_nir": {"max_abs_logit_diff": float((fx_out - fb_out).abs().max()),
                         "pred_agreement": float((pred(fx_out) == pred(fb_out)).float().mean())},
    }
    a, s, i, f = res["accuracy"], res["snntorch"], res["szo_import"], res["fixed_vs_nir"]
    print(f"| comparison ({res['samples']} test samples, T = {res['T']}) | max abs logit diff | predictions agree | "
          f"accuracy |\n|---|---|---|---|\n"
          f"| szo import of the .nir vs szo (float32 / float64) | {i['max_abs_logit_diff_f32']:.3g} / "
          f"{i['max_abs_logit_diff_f64']:.3g} | {100 * i['pred_agreement']:.2f}% | {100 * a['szo_import']:.2f}% "
          f"(szo {100 * a['szo']:.2f}%) |\n"
          f"| snnTorch import of the .nir vs szo | {s['max_abs_logit_diff']:.3g} | {100 * s['pred_agreement']:.2f}% | "
          f"{100 * a['snntorch']:.2f}% |\n"
          f"| same, snnTorch's late reset term dropped (diagnostic) | "
          f"{res['snntorch_late_reset_patched']['max_abs_logit_diff']:.3g} | "
          f"{100 * res['snntorch_late_reset_patched']['pred_agreement']:.2f}% | "
          f"{100 * res['snntorch_late_reset_patched']['accuracy']:.2f}% |\n"
          f"| exported fixed-point graph vs szo.hw fixed-point net | {f['max_abs_logit_diff']:.3g} | "
          f"{100 * f['pred_agreement']:.2f}% | {100 * a['fixed_nir_import']:.2f}% (fixed {100 * a['fixed']:.2f}%) |")
    print(f"snnTorch spike agreement per layer: {[round(v, 5) for v in s['spike_agreement_per_layer']]}; "
          f"samples with a late reset: {100 * s['samples_with_late_reset']:.1f}%")
    if args.out:
        atomic_write_json(args.out, res)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
