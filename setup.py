"""Keel: distributed LLM pretraining on DeepSpeed with the stability and recovery a long run needs."""

from setuptools import find_packages, setup

setup(
    name="keel",
    version="0.1.0",
    description="Distributed LLM pretraining: 4D parallelism on DeepSpeed, with stability guards and recovery",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["keel", "keel.*"]),
    install_requires=[
        "torch>=2.4",
        # keel/adapters/ use DeepSpeed and torch internals verified with these ranges (tests/test_adapters.py);
        # keel/model/hf.py needs transformers 5's `rope_parameters`
        "deepspeed>=0.19.8,<0.20",
        "transformers>=5.0,<6",
        "sentencepiece>=0.2",
        "tokenizers>=0.21",  # data.tokenizer: an HF tokenizer.json (encode_batch_fast)
        "pyyaml>=6",
        "numpy>=1.24",
        "tqdm>=4.60",
        "tensorboard>=2.14",
        "psutil>=5.9",  # host memory (preflight, the planner), the OOM report
        "zstandard>=0.22",  # .jsonl.zst / .txt.zst corpora (a 5 MB wheel)
    ],
    extras_require={
        # the lr-find tests read matplotlib's plot; Liger's RoPE is tested on CPU under TRITON_INTERPRET=1;
        # tests/test_megatron_format.py checks Keel's token files against Megatron-Core's reader and builder
        "test": [
            "pytest>=8",
            "pytest-xdist>=3.6",  # cores + 1 workers (pyproject.toml's addopts, tests/conftest.py)
            "filelock>=3.12",  # the workers share the suite's launches (tests/keel_runs.py)
            "ruff>=0.5",
            "matplotlib>=3.7",
            "liger-kernel>=0.8",
            "triton>=3.0",
            "megatron-core>=0.12",
            "pyarrow>=14",
            "hypothesis>=6.100",  # tests/faults/test_config_fuzz.py
            "torchao>=0.18,<0.19",  # tests/test_fp8*.py: model.fp8, emulated on CPU
        ],
        # model.fp8: torchao's FP8 and MX recipes; keel/adapters/torchao_internals.py reads its internals, verified
        # on this range (a 3 MB wheel, only for FP8 runs, so not a core dependency)
        "fp8": ["torchao>=0.18,<0.19"],
        "parquet": ["pyarrow>=14"],  # parquet corpora (a 55 MB wheel, so not a core dependency)
        "liger": ["liger-kernel>=0.8", "triton>=3.0"],  # model.kernels: auto picks it on CUDA
        "wandb": ["wandb>=0.16"],
        "triton": ["triton>=3.0"],
        "plot": ["matplotlib>=3.7"],
    },
    entry_points={"console_scripts": ["keel=keel.launcher.cli:main"]},
)
