"""The installable core: onebit_bert needs torch, numpy and pyyaml only, and declares so."""

from __future__ import annotations

import subprocess
import sys
import tomllib

from tests.helpers.runs import REPO

PIPELINE_ONLY = (
    "transformers",
    "datasets",
    "tokenizers",
    "evaluate",
    "wandb",
    "matplotlib",
    "pyarrow",
    "tqdm",
    "tensorboard",
    "accelerate",
    # the stages and the orchestrator are not part of the installed package
    "data_prep",
    "pretrain",
    "finetune",
    "pipeline",
    "smoke_data",
    "bench",
)

IMPORT_EVERYTHING = """
import importlib, pkgutil, sys
import numpy, torch, yaml
# torch's own lazy imports (dynamo probes for optional packages) happen first
torch.optim.AdamW(torch.nn.Linear(2, 1).parameters()).step()
before = {name.split(".")[0] for name in sys.modules}
import onebit_bert
names = [m.name for m in pkgutil.walk_packages(onebit_bert.__path__, "onebit_bert.")]
for name in names:
    importlib.import_module(name)
from onebit_bert.distributed.comm import Communicator
from onebit_bert.optim.build import OptimizerConfig, build_optimizer
from onebit_bert.optim.registry import OPTIMIZERS
for optimizer in OPTIMIZERS:
    model = torch.nn.Linear(3, 2)
    build_optimizer(OptimizerConfig(name=optimizer), model, Communicator(None))
new = {name.split(".")[0] for name in sys.modules} - before
print(" ".join(sorted(new)))
print(len(names))
"""


def test_the_core_declares_only_torch_numpy_and_pyyaml_with_a_torch_range():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = [d.split(">")[0].split("=")[0].split("<")[0].strip() for d in project["dependencies"]]
    assert names == ["torch", "numpy", "pyyaml"]
    torch_req = project["dependencies"][0]
    assert ">=" in torch_req and "==" not in torch_req, torch_req
    extras = project["optional-dependencies"]
    assert {"pipeline", "wandb", "tensorboard", "dev"} <= set(extras)
    assert any(d.startswith("transformers") for d in extras["pipeline"])
    assert (REPO / "LICENSE").is_file()


def test_every_core_module_imports_none_of_the_pipeline_packages():
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_EVERYTHING],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    new_modules, count = out.stdout.strip().splitlines()
    assert int(count) > 20  # every module of the package was imported
    assert "onebit_bert" in new_modules.split()
    assert not set(new_modules.split()) & set(PIPELINE_ONLY), new_modules
