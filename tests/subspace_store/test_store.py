"""SubspaceStore: round trip, integrity, layout checks, crash-safe saves, reduced-precision storage."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import subspace_store.store as store_mod
from subspace_store import (
    LayoutMismatchError,
    Subspace,
    SubspaceIntegrityError,
    SubspaceNotFoundError,
    SubspaceStore,
    build_subspace,
)


def model(out: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 30), nn.ReLU(), nn.Linear(30, out))


def make_subspace(m: nn.Module, n: int = 12, k: int = 5, seed: int = 0) -> Subspace:
    g = torch.Generator().manual_seed(seed)
    base = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    vecs = [base + torch.randn(base.shape, generator=g) * (1 + i) * 0.01 for i in range(n)]
    sub = build_subspace(vecs, k, progress=False)
    sub.layout = [(name, tuple(p.shape)) for name, p in m.named_parameters()]
    sub.model, sub.fingerprint = "mlp", "f" * 64
    return sub


def test_round_trip_bit_exact(tmp_path):
    m = model()
    sub = make_subspace(m)
    st = SubspaceStore(tmp_path)
    st.save("mlp-k5", sub)
    assert st.list() == ["mlp-k5"] and st.exists("mlp-k5") and "mlp-k5" in st
    got = st.load("mlp-k5", model=m)
    for f in ("basis", "mean", "reference", "eigenvalues", "explained_variance_ratio"):
        assert torch.equal(getattr(got, f), getattr(sub, f)), f
    assert got.layout == sub.layout and got.model == "mlp" and got.provenance["N"] == 12
    info = st.info("mlp-k5")
    assert info["k"] == 5 and info["N"] == 12 and info["d"] == sub.d and info["storage_dtype"] == "float32"
    assert set(info["tensors"]) == {"basis", "mean", "reference", "eigenvalues", "explained_variance_ratio"}
    assert info["created"].endswith("+00:00")
    with pytest.raises(ValueError, match="already exists"):
        st.save("mlp-k5", sub)
    st.delete("mlp-k5")
    assert st.list() == [] and not st.exists("mlp-k5")


def test_env_default_root(tmp_path, monkeypatch):
    monkeypatch.setenv("SZO_SUBSPACE_ROOT", str(tmp_path / "r"))
    assert SubspaceStore().root == tmp_path / "r"


def test_layout_mismatch_names_parameter(tmp_path):
    st = SubspaceStore(tmp_path)
    st.save("s", make_subspace(model(3)))
    with pytest.raises(LayoutMismatchError, match=r"parameter #2 is 2\.weight \[3, 30\] in the subspace but 2\.weight \[4, 30\] in the model"):
        st.load("s", model=model(4))


@pytest.mark.parametrize("name", ["", "..", "../x", "a/b", ".hidden", "a..b", "a\\b", None])
def test_invalid_names(tmp_path, name):
    with pytest.raises(ValueError, match="invalid subspace name"):
        SubspaceStore(tmp_path).save(name, make_subspace(model()))


def test_unknown_name_lists_available(tmp_path):
    st = SubspaceStore(tmp_path)
    st.save("alpha", make_subspace(model()))
    with pytest.raises(SubspaceNotFoundError, match="available: alpha"):
        st.load("beta")


def test_tampered_byte_detected(tmp_path):
    st = SubspaceStore(tmp_path)
    st.save("s", make_subspace(model()))
    f = tmp_path / "s" / "basis.safetensors"
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0x01
    f.write_bytes(bytes(b))
    with pytest.raises(SubspaceIntegrityError, match="sha256"):
        st.load("s")


def test_truncated_file_detected(tmp_path):
    st = SubspaceStore(tmp_path)
    st.save("s", make_subspace(model()))
    f = tmp_path / "s" / "basis.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size - 100])
    with pytest.raises(SubspaceIntegrityError, match="truncated or corrupt"):
        st.load("s")
    (tmp_path / "s" / "manifest.json").write_text('{"format": "szo-subspace", "version": 1}')
    with pytest.raises(SubspaceIntegrityError, match="missing or has the wrong type"):
        st.load("s")


def entries(root) -> list[str]:
    """What a store root holds besides the per-entry writer lock files (``.NAME.lock``, kept on purpose)."""
    return sorted(n for n in os.listdir(root) if not (n.startswith(".") and n.endswith(".lock")))


def test_crash_mid_save_keeps_old_entry(tmp_path, monkeypatch):
    st = SubspaceStore(tmp_path)
    old = make_subspace(model(), seed=0)
    st.save("s", old)

    def die(*a, **k):
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(store_mod, "_write_safetensors", die)
    with pytest.raises(KeyboardInterrupt):
        st.save("s", make_subspace(model(), seed=1), overwrite=True)
    with pytest.raises(KeyboardInterrupt):
        st.save("fresh", make_subspace(model(), seed=1))
    monkeypatch.undo()
    assert st.list() == ["s"] and entries(tmp_path) == ["s"]  # no temp dirs left
    assert torch.equal(st.load("s").basis, old.basis)

    # failure of the second rename (new entry into place) rolls the old entry back
    real, calls = os.replace, []

    def flaky(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("disk gone")
        return real(src, dst)

    monkeypatch.setattr(store_mod.os, "replace", flaky)
    with pytest.raises(OSError):
        st.save("s", make_subspace(model(), seed=2), overwrite=True)
    monkeypatch.undo()
    assert torch.equal(st.load("s").basis, old.basis)
    assert entries(tmp_path) == ["s"]

    new = make_subspace(model(), seed=3)
    st.save("s", new, overwrite=True)
    assert torch.equal(st.load("s").basis, new.basis)


@pytest.mark.parametrize("sdt,u", [(torch.float16, 2.0**-11), (torch.bfloat16, 2.0**-8)])
def test_reduced_precision_storage_bound(tmp_path, sdt, u):
    m = model()
    sub = make_subspace(m)
    st = SubspaceStore(tmp_path)
    st.save("s", sub, storage_dtype=sdt)
    assert st.info("s")["storage_dtype"] == str(sdt).replace("torch.", "")
    got = st.load("s", model=m)  # converted back to float32
    assert got.basis.dtype == torch.float32 and torch.equal(got.reference, sub.reference)
    P, Q = sub.basis.double(), got.basis.double()
    # round to nearest: relative error <= unit roundoff u; below the normal range (fp16) absolute <= 2^-25
    bound = P.abs() * u + 2.0**-25
    assert ((Q - P).abs() <= bound).all()
    assert (Q - P).abs().max() > 0  # really stored in reduced precision
    # column norms of the error are <= u, so |Q^T Q - I| <= 2u + u^2
    err = (Q.T @ Q - torch.eye(sub.k, dtype=torch.float64)).abs().max()
    assert err <= 2 * u + u * u
    assert (tmp_path / "s" / "basis.safetensors").stat().st_size < sub.d * sub.k * 4


def test_storage_dtype_validated(tmp_path):
    with pytest.raises(ValueError, match="storage_dtype must be one of"):
        SubspaceStore(tmp_path).save("s", make_subspace(model()), storage_dtype=torch.int8)


def test_total_variance_only_in_provenance_and_old_manifests_still_load(tmp_path):
    import json

    m = model()
    sub = make_subspace(m)
    st = SubspaceStore(tmp_path)
    st.save("e", sub)
    man_path = tmp_path / "e" / "manifest.json"
    man = json.loads(man_path.read_text())
    assert "total_variance" not in man  # no top-level copy of provenance["total_variance"]
    assert man["provenance"]["total_variance"] == pytest.approx(sub.provenance["total_variance"])
    man["total_variance"] = man["provenance"]["total_variance"]  # as older szo versions wrote it
    man_path.write_text(json.dumps(man))
    got = st.load("e", model=m)
    assert torch.equal(got.basis, sub.basis) and got.provenance["total_variance"] == man["total_variance"]


def test_killed_writer_leftovers_are_listed_cleaned_and_an_old_entry_is_put_back(tmp_path):
    """A writer SIGKILLed mid-overwrite leaves .NAME.old-PID (the old entry, renamed away) and
    .NAME.tmp-PID (the new one, unfinished): ls names them, the next writer restores the old
    entry and removes the rest; rm removes a partial write that never had an entry."""
    import subprocess
    import sys

    st = SubspaceStore(tmp_path)
    old = make_subspace(model(), seed=0)
    st.save("s", old)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    os.replace(tmp_path / "s", tmp_path / f".s.old-{dead}")  # the state between the two renames
    (tmp_path / f".s.tmp-{dead}").mkdir()
    (tmp_path / f".ghost.tmp-{dead}").mkdir()
    assert not st.exists("s") and sorted(p["name"] for p in st.partial()) == ["ghost", "s", "s"]
    errors = {r["name"]: r["error"] for r in st.summaries()}
    assert "partial write left by process" in errors["ghost"] and "szo subspace rm ghost" in errors["ghost"]
    st.save("other", make_subspace(model(), seed=2))  # another name: leaves s's leftovers alone
    assert (tmp_path / f".s.old-{dead}").is_dir()
    with pytest.raises(ValueError, match="already exists"):
        st.save("s", make_subspace(model(), seed=1))  # the writer lock put the old entry back first
    assert torch.equal(st.load("s").basis, old.basis) and not (tmp_path / f".s.tmp-{dead}").exists()
    st.delete("ghost")
    assert entries(tmp_path) == ["other", "s"] and st.partial() == []


def test_two_writers_of_one_name_one_wins_the_other_gets_one_line(tmp_path):
    import fcntl

    st = SubspaceStore(tmp_path)
    st.root.mkdir(parents=True, exist_ok=True)
    fd = os.open(tmp_path / ".s.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another process is writing entry s
    try:
        with pytest.raises(store_mod.StoreBusyError, match="being written by another process"):
            st.save("s", make_subspace(model(), seed=0))
        st.save("t", make_subspace(model(), seed=0))  # other names are not blocked
    finally:
        os.close(fd)
    st.save("s", make_subspace(model(), seed=0))


def test_non_finite_bases_are_refused_on_save_and_load(tmp_path):
    st = SubspaceStore(tmp_path)
    bad = make_subspace(model(), seed=0)
    bad.basis[3, 1] = float("nan")
    with pytest.raises(ValueError, match="tensor 'basis' holds 1 non-finite value"):
        st.save("nan", bad)
    assert not st.exists("nan")
    good = make_subspace(model(), seed=0)
    st.save("g", good)
    # a NaN written with a matching hash record (a buggy or foreign writer): refused when loading
    from safetensors.torch import load_file, save_file

    path = tmp_path / "g" / "basis.safetensors"
    t = load_file(path)
    t["reference"][0] = float("inf")
    save_file(t, path, metadata={"format": store_mod.FORMAT, "version": str(store_mod.FORMAT_VERSION)})
    with pytest.raises(store_mod.SubspaceIntegrityError, match="'reference' holds 1 non-finite"):
        st.load("g", verify=False)


def test_digest_pins_the_content_not_the_name(tmp_path):
    st = SubspaceStore(tmp_path)
    st.save("s", make_subspace(model(), seed=0))
    a = st.digest("s")
    st.save("s", make_subspace(model(), seed=0), overwrite=True)
    assert st.digest("s") == a  # same content, same digest
    st.save("s", make_subspace(model(), seed=1), overwrite=True)
    assert st.digest("s") != a


@pytest.mark.parametrize("field, index", [("explained_variance_ratio", 0), ("eigenvalues", 2), ("mean", 7)])
def test_every_tensor_is_checked_at_save(tmp_path, field, index):
    """A NaN explained-variance ratio was saved without a word, and every later load refused the entry."""
    st = SubspaceStore(tmp_path)
    bad = make_subspace(model())
    getattr(bad, field)[index] = float("nan")
    with pytest.raises(ValueError, match=rf"^subspace 'e': tensor '{field}' holds 1 non-finite value"):
        st.save("e", bad)
    assert not st.exists("e") and st.list() == [] and st.partial() == []


@pytest.mark.parametrize("broken, phrase", [
    (lambda p: p.zero_(), "max |P^T P - I| = 1 > 0.01"),          # all zero: the parameters cannot move
    (lambda p: p.mul_(2.0), "max |P^T P - I| = 3 > 0.01"),        # scaled
    (lambda p: p.copy_(p[:, :1].expand_as(p)), "not orthonormal"),  # one direction k times
])
def test_a_basis_that_is_not_orthonormal_is_refused_at_save(tmp_path, broken, phrase):
    st = SubspaceStore(tmp_path)
    bad = make_subspace(model())
    broken(bad.basis)
    with pytest.raises(ValueError, match=r"^subspace 'b': the basis is not orthonormal \(") as e:
        st.save("b", bad)
    assert phrase in str(e.value)
    assert not st.exists("b")


@pytest.mark.parametrize("sdt", ["float32", "float16", "bfloat16"])
def test_orthonormal_bases_pass_in_every_storage_dtype(tmp_path, sdt):
    from subspace_store.store import ORTHONORMAL_TOL, orthonormality_error
    from subspace_store.variants import random_subspace

    st = SubspaceStore(tmp_path)
    m = model()
    sub = make_subspace(m)
    ref = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    for name, s in (("built", sub), ("random", random_subspace(ref, 7, seed=3))):
        st.save(name, s, storage_dtype=sdt)
        got = st.load(name)
        err = orthonormality_error(got.basis)
        assert err <= ORTHONORMAL_TOL[store_mod.STORAGE_DTYPES[sdt]] / 2, (name, err)  # rounding stays well inside


def test_a_stored_basis_that_is_not_orthonormal_is_refused_at_load(tmp_path):
    """An all-zero basis written by a foreign writer (with a matching sha256 record) was loaded and
    trained in to "completed" without the parameters being able to move."""
    from safetensors.torch import load_file, save_file

    st = SubspaceStore(tmp_path)
    st.save("g", make_subspace(model()))
    path = tmp_path / "g" / "basis.safetensors"
    t = load_file(path)
    t["basis"].zero_()
    save_file(t, path, metadata={"format": store_mod.FORMAT, "version": str(store_mod.FORMAT_VERSION)})
    with pytest.raises(SubspaceIntegrityError, match=r"basis.safetensors: the basis is not orthonormal \(max \|P\^T P - I\| "
                                                     r"= 1 > 0.01"):
        st.load("g", verify=False)
