"""mnist5k-c: cache-filling time per corruption and how much of each digit a corruption leaves.

1. Generates (or finds in the cache) the 15 corruptions at ``--severity`` for the 4,000 train and
   1,000 test images of mnist5k (``szo.data.corrupted.generate_corrupted``), timing each
   (corruption, split); pass an empty ``--cache-dir`` for fresh generation times.
2. Linear probe per corruption: a multinomial logistic regression (scikit-learn, pixels
   standardised as the model sees them) fit on the corrupted train split and scored on the
   corrupted test split, and the same on clean mnist5k: a rough measure of the label information
   the corruption leaves (a ceiling for a *linear* reader, not for an SNN).

Writes bench/results/mnist5k_c.json.

    python bench/mnist5k_c.py --cache-dir /tmp/m5kc-cache     # fresh: ~2 min generation + ~1 min probes
"""
from __future__ import annotations

import argparse
import time

from common import machine_info, set_threads, write_result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--severity", type=int, default=5)
    ap.add_argument("--cache-dir", default=None, help="default: ~/.cache/szo/mnist5k-c")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-probe", action="store_true", help="only fill the cache and time it")
    args = ap.parse_args()
    set_threads(args.threads)
    import numpy as np
    from sklearn.linear_model import LogisticRegression
    from tqdm.auto import tqdm

    import szo.data as D
    from szo.data import CORRUPTIONS
    from szo.data.corrupted import generate_corrupted

    out = {"machine": machine_info(), "severity": args.severity, "generate_s": {}, "probe_test_acc": {}}
    t0 = time.perf_counter()
    for split in ("test", "train"):
        out["generate_s"][split] = generate_corrupted("mnist5k", splits=(split,), severities=(args.severity,),
                                                      cache_dir=args.cache_dir)
    out["generate_total_s"] = time.perf_counter() - t0
    out["loadavg_after_generation"] = machine_info()["loadavg_1m"]
    print(f"generation: {out['generate_total_s']:.1f} s "
          + ", ".join(f"{c} {out['generate_s']['test'][c] + out['generate_s']['train'][c]:.1f}" for c in CORRUPTIONS))
    if not args.no_probe:
        def probe(get) -> float:
            tr, te = get("train"), get("test")
            clf = LogisticRegression(max_iter=300, C=0.1)
            clf.fit(tr.images.flatten(1).numpy(), tr.targets.numpy())
            return float(np.mean(clf.predict(te.images.flatten(1).numpy()) == te.targets.numpy()))

        for c in tqdm(["clean", *CORRUPTIONS], desc="linear probes"):
            if c == "clean":
                acc = probe(lambda s: D.get_dataset("mnist5k", s))
            else:
                acc = probe(lambda s: D.get_dataset("mnist5k-c", s, corruption=c, severity=args.severity,
                                                    cache_dir=args.cache_dir))
            out["probe_test_acc"][c] = acc
            tqdm.write(f"{c:18s} linear probe test acc {100 * acc:6.2f} %")
    write_result("mnist5k_c", out)


if __name__ == "__main__":
    main()
