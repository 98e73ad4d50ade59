"""N-MNIST's label folders (issue 49): tonic takes a recording's label from the last character of its
folder's path, so ``Train/five`` ended in ``invalid literal for int() with base 10: 'e'`` and ``Train/15``
would have been read as label 5. szo refuses any other layout in one line naming the folder."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from szo.data import get_dataset

pytest.importorskip("tonic")

RECORDING = Path(__file__).parent / "nmnist" / "sample_nmnist.bin"


@pytest.mark.parametrize("where", ["five", "15", "3/extra"])
def test_a_folder_that_is_not_a_label_is_named(tmp_path, where):
    root = tmp_path / "data"
    for folder in ("3", where):
        (root / "NMNIST" / "Train" / folder).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(RECORDING, root / "NMNIST" / "Train" / folder / "00001.bin")
    bad = root / "NMNIST" / "Train" / where
    with pytest.raises(ValueError, match=rf"^N-MNIST train: {bad} holds .bin recordings but is not a label folder; "
                                         rf"valid: {root / 'NMNIST' / 'Train'}/<label>/<id>.bin with label 0, 1, "):
        get_dataset("nmnist", "train", data_dir=root, T=2, cache=False)
    shutil.rmtree(bad)
    assert get_dataset("nmnist", "train", data_dir=root, T=2, cache=False).targets == [3]
