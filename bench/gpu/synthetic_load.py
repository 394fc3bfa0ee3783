"""Random layers made when the engine loads a synthetic model whose file holds only its
embedding, output layer and final norm (bench/gpu/synthetic_models.py --target-layers-at-load):
the layers are drawn on the GPU where there is one, so a target of 32B shapes (64 GB in bf16)
runs on a machine whose disk cannot hold it as a file. Speed does not depend on the values.

    python bench/gpu/synthetic_load.py ssd ARGS...   # the `ssd` command, with such models loadable
"""
import json
import sys
from pathlib import Path

import torch

from ssd.models import loader
from synthetic_models import AT_LOAD, layers


def install() -> None:
    """Make loader.read_weights add the random layers of a folder that asks for them."""
    read = loader.read_weights

    def read_weights(folder: Path) -> dict[str, torch.Tensor]:
        found = read(folder)
        marker = Path(folder) / AT_LOAD
        if marker.is_file():
            made = json.loads(marker.read_text())
            device = "cuda" if torch.cuda.is_available() else "cpu"
            gen = torch.Generator(device).manual_seed(made["seed"])
            cfg = json.loads((Path(folder) / "config.json").read_text())
            found |= layers(cfg, gen, getattr(torch, made["dtype"]), device, device)
        return found

    loader.read_weights = read_weights


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] != "ssd":
        sys.exit(__doc__.split("\n\n")[1].strip())
    install()
    from ssd.cli import main as ssd
    sys.exit(ssd(sys.argv[2:]))


if __name__ == "__main__":
    main()
