"""megatron-earl: a Megatron-Core plugin for long-context agentic RL post-training.

Tested ranges (megatron_earl/docs/install.md, "Tested versions"): Python 3.11, megatron-core
0.16.x, torch 2.13 (the CPU build, on development/CI machines) and 2.14 (2.14.1+cu130, the build
SGLang 0.5.22-0.5.23 pin, its unit, distributed and emulation tests run on CPU). Install torch first
on a CPU machine (`pip install torch==2.13.0`): an unpinned torch resolves to a multi-GB CUDA
build. tests/unit/test_install_resolution.py resolves the GPU extras against PyPI.
"""

from setuptools import find_packages, setup

setup(
    name="megatron-earl",
    version="0.1.0",
    description="Megatron-Core plugin for long-context agentic RL (EARL): per-phase parallel "
    "layouts, decentralized data dispatch, multi-turn rollouts",
    # Every Megatron-Core patch lives in the top-level patches/, installed as megatron_earl.patches.
    packages=[
        *find_packages(include=["megatron_earl", "megatron_earl.*"]),
        "megatron_earl.patches",
    ],
    package_dir={"megatron_earl.patches": "patches"},
    python_requires=">=3.11",
    install_requires=[
        # The torch releases the tests ran on (see above); the range admits the torch the
        # [sglang] releases pin, so one environment holds SGLang, TE and this project.
        "torch>=2.13.0,<2.15",
        "megatron-core>=0.16.0,<0.17",
        "omegaconf>=2.3,<2.5",
        "numpy>=1.26,<3",
        "psutil>=5.9",
        "packaging>=23",
        "jsonschema>=4.18",
        "aiohttp>=3.9,<4",
        "pyyaml>=6",
    ],
    extras_require={
        # Transformer Engine's torch part is an sdist compiled against the installed torch: install
        # it with --no-build-isolation after torch (docs/install.md, "On a GPU machine").
        "te": ["transformer-engine[pytorch]>=2.0"],
        # Each SGLang release pins one torch: 0.5.18-0.5.21 pin 2.13.0, 0.5.22-0.5.23 pin 2.14.1
        # (earlier ones pin an older torch: 0.5.17 2.11.0, 0.5.3 2.8.0). 0.5.23 is the one tested
        # (rollout.sglang.identity.TESTED_SGLANG_VERSIONS).
        "sglang": ["sglang>=0.5.18,<0.6"],
        # No [apex] extra: PyPI's "apex" is an unrelated package; NVIDIA Apex is built from source
        # (README "On GPUs"), and Megatron-Core uses it when importable.
        # Qwen3 needs transformers >= 4.51; safetensors for HF <-> Megatron conversion.
        "hf": ["transformers>=4.51", "safetensors>=0.4"],
        "plot": ["matplotlib>=3.7"],
        # `megatron-earl bench peer`: TRL's GRPOTrainer as the peer (its rollout_func and
        # _generate_single_turn are experimental/private: tested with 1.16 only).
        "bench": ["trl>=1.16,<1.17", "transformers>=4.56.2", "safetensors>=0.4"],
        "tensorboard": ["tensorboard>=2.14"],
        # SGLang's Rust router in front of the engines (rollout.router: rollout/sglang/router.py);
        # runs on CPU.
        "router": ["sglang-router>=0.3.2,<0.4"],
        "dev": [
            "pytest>=8,<10",
            "pytest-timeout>=2.3",
            "pytest-xdist>=3.5",  # the README's test command runs the main suite on 2 workers
            "ruff>=0.6",
            "matplotlib>=3.7",
            "tensorboard>=2.14",
            "transformers>=4.51",
            "safetensors>=0.4",
            "trl>=1.16,<1.17",  # tests/integration/test_bench_peer.py (installs in < 1 min)
            "sglang-router>=0.3.2,<0.4",  # tests/integration/test_router.py (a Rust wheel)
            "uv>=0.13",  # tests/unit/test_install_resolution.py resolves the GPU extras
        ],
    },
    entry_points={"console_scripts": ["megatron-earl=megatron_earl.cli.main:main"]},
)
