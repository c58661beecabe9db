"""megatron_harts: tree-packed agentic RL training for hybrid-attention models on Megatron-Core."""
from setuptools import find_packages, setup

setup(
    name="megatron_harts",
    version="0.1.0",
    description="HARTS: prefix-shared training of hybrid-attention models over rollout trees, "
    "as a Megatron-Core plugin",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron_harts", "megatron_harts.*"]),
    # the suffix drafter's compiled parts: C source, built with the system compiler at first use
    package_data={"megatron_harts.rollout.war": ["suffix_expand.c"]},
    python_requires=">=3.12",
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.19,<0.20",
        "fla-core>=0.6,<0.7",
        "flash-linear-attention>=0.6,<0.7",
        "triton>=3.7.1; platform_system == 'Linux'",  # fla 0.6 refuses 3.4-3.7.0 on Hopper (wrong grads)
        "numpy>=1.26",
        "tqdm>=4.60",
    ],
    extras_require={
        "test": ["pytest>=8", "hypothesis>=6.100", "pytest-timeout>=2.3", "transformers>=5.0",
                 "matplotlib>=3.8", "scipy>=1.11", "ray>=2.40", "safetensors>=0.4", "sglang-router==0.3.2"],
        # the RL loop (megatron_harts.rollout): Ray actors, the embedded transformers engine, checkpoints;
        # sandboxes need bubblewrap (apt-get install bubblewrap) and root for overlayfs mounts
        "rollout": ["ray>=2.40", "transformers>=5.0", "safetensors>=0.4"],
        "sglang": ["sglang>=0.5"],
        # WAR (megatron_harts.rollout.war): the sglang-router anchor of the scheduler benchmark;
        # arctic-inference (offline drafter comparison) builds from its sdist, see docs/war.md
        "war": ["sglang-router==0.3.2"],
        "bench": ["matplotlib>=3.8", "scipy>=1.11"],
        "te": ["transformer-engine>=2.0"],
        "apex": ["apex"],
    },
    entry_points={"console_scripts": ["harts-demo=megatron_harts.demo:main",
                                      "harts-verify=megatron_harts.verify:main",
                                      "harts-rl=megatron_harts.rollout.cli:main"],
                  # WAR: SGLang's general plugins (speculative algorithm HARTS_SUFFIX)
                  "sglang.srt.plugins": ["harts_suffix = megatron_harts.rollout.war.sglang_plugin:register"]},
)
