from pathlib import Path

from setuptools import find_packages, setup

requirements = Path(__file__).with_name("requirements.txt").read_text().split()

setup(
    name="kraken-cookbook",
    version="0.1.0",
    description="Triton kernels that communicate through PyTorch symmetric memory, with Helion twins and one benchmark",
    long_description=Path(__file__).with_name("README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["kraken*", "helion_ports*", "benchmark*"]),
    install_requires=requirements,
    # matplotlib draws `--plot` figures; the tests draw one from a fixture, so they need it too. pytest-xdist spreads
    # the CPU tests over workers (the README's test command).
    extras_require={"plot": ["matplotlib"], "test": ["pytest", "pytest-xdist", "matplotlib"]},
)
